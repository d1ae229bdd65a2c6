//! Filter: the rows of a batch where a predicate holds, evaluated block by block.
//!
//! A filter reads each column its predicate compares twice: once to compute the mask, once to
//! copy the kept values. Over a whole partition (20 MB a column) the second read comes from
//! memory again, and `perf` put the two passes at 70% of the scan query (filter + sum). So the
//! predicate is evaluated over blocks of rows small enough to stay in the core's cache, and the
//! block's fixed-width values are compacted right after its mask, while they are still there.
//! Validity bitmaps and other columns (strings, booleans, lists...) are filtered by Arrow's
//! kernel once, over the whole mask, at the end.
//!
//! The kept values go to one reused block per column (`memory::buffers`), sized from the share
//! the first block kept; a column that outgrows it moves once to room for every row left.

use std::sync::Arc;

use arrow::array::{
    Array, ArrayRef, ArrowPrimitiveType, AsArray, BooleanArray, BooleanBufferBuilder,
    PrimitiveArray, RecordBatch, RecordBatchOptions, downcast_primitive,
};
use arrow::buffer::{BooleanBuffer, NullBuffer};
use arrow::compute::{FilterBuilder, FilterPredicate};
use arrow::datatypes::DataType;
use arrow::error::ArrowError;

use super::ops::{OpError, arrow_err};
use super::{compress, eval};
use crate::expr::Expr;
use crate::memory::buffers::{self, PooledVec};

/// Rows per block: 256 KiB of an 8-byte column, a quarter of the L2 cache of the machines we
/// measured on (1 MiB), so that a predicate over a few columns still stays in it.
const BLOCK_ROWS: usize = 32 << 10;

/// Above this share of rows kept, a block's values are copied in runs of kept rows rather than
/// one row at a time (Arrow's own filter switches at the same point).
const RUNS_ABOVE_SELECTIVITY: f64 = 0.8;

/// The rows of `batch` where `predicate` is true (null counts as false).
pub fn filter(batch: &RecordBatch, predicate: &Expr) -> Result<RecordBatch, OpError> {
    let rows = batch.num_rows();
    let mut selected = BooleanBufferBuilder::new(rows);
    let mut kept_rows_in_all = 0;
    let mut compactors: Option<Vec<Option<Box<dyn Compactor>>>> = None;
    let mut start = 0;
    // One block at least, so that an empty batch still checks the predicate.
    loop {
        let len = BLOCK_ROWS.min(rows - start);
        let block = batch.slice(start, len);
        let mask = kept_rows(&eval::evaluate_predicate(predicate, &block)?);
        let kept = mask.count_set_bits();
        let compactors = compactors.get_or_insert_with(|| {
            let capacity = expected_kept(kept, len, rows);
            batch
                .columns()
                .iter()
                .map(|column| compactor(column.data_type(), capacity))
                .collect()
        });
        for (column, compactor) in block.columns().iter().zip(compactors.iter_mut()) {
            if let Some(compactor) = compactor {
                compactor.append(column.as_ref(), &mask, kept, rows - start);
            }
        }
        selected.append_buffer(&mask);
        kept_rows_in_all += kept;
        start += len;
        if start >= rows {
            break;
        }
    }
    let whole = WholeMask::new(selected.finish());
    let columns = batch
        .columns()
        .iter()
        .zip(compactors.into_iter().flatten())
        .map(|(column, compactor)| match compactor {
            Some(compactor) => {
                let nulls = match column.nulls() {
                    Some(nulls) if nulls.null_count() > 0 => {
                        let validity =
                            whole.apply(&BooleanArray::new(nulls.inner().clone(), None))?;
                        Some(NullBuffer::new(validity.as_boolean().values().clone()))
                    }
                    _ => None,
                };
                Ok(compactor.finish(nulls))
            }
            None => whole.apply(column.as_ref()),
        })
        .collect::<Result<Vec<_>, ArrowError>>()
        .map_err(arrow_err("filter"))?;
    RecordBatch::try_new_with_options(
        batch.schema(),
        columns,
        &RecordBatchOptions::new().with_row_count(Some(kept_rows_in_all)),
    )
    .map_err(arrow_err("filter"))
}

/// The mask's true bits, its nulls counted as false.
fn kept_rows(mask: &BooleanArray) -> BooleanBuffer {
    match mask.nulls() {
        Some(nulls) if nulls.null_count() > 0 => mask.values() & nulls.inner(),
        _ => mask.values().clone(),
    }
}

/// Room for the kept values of a column of `rows` rows, after its first block of `len` rows
/// kept `kept`: exact when that block was all, otherwise the same share with an eighth more
/// and a block to spare, at most every row.
fn expected_kept(kept: usize, len: usize, rows: usize) -> usize {
    if len == rows {
        return kept + compress::SLACK;
    }
    let share = kept as f64 / len as f64 * 1.125;
    ((rows as f64 * share) as usize + BLOCK_ROWS).min(rows) + compress::SLACK
}

/// Arrow's filter over the whole mask, built once, and only if a column needs it.
struct WholeMask {
    selected: BooleanBuffer,
    predicate: std::cell::OnceCell<FilterPredicate>,
}

impl WholeMask {
    fn new(selected: BooleanBuffer) -> Self {
        WholeMask {
            selected,
            predicate: std::cell::OnceCell::new(),
        }
    }

    fn apply(&self, array: &dyn Array) -> Result<ArrayRef, ArrowError> {
        self.predicate
            .get_or_init(|| {
                FilterBuilder::new(&BooleanArray::new(self.selected.clone(), None))
                    .optimize()
                    .build()
            })
            .filter(array)
    }
}

/// The kept values of one fixed-width column, gathered block by block.
trait Compactor {
    /// Appends the values of `block` (the column's rows in one block) whose bit in `mask` is
    /// set; `kept` is how many, and `rows_left` how many rows there are from this block on.
    fn append(&mut self, block: &dyn Array, mask: &BooleanBuffer, kept: usize, rows_left: usize);

    /// The filtered column, with `nulls` (the column's validity, filtered) as its validity.
    fn finish(self: Box<Self>, nulls: Option<NullBuffer>) -> ArrayRef;
}

/// A compactor for a column of `data_type` with room for `capacity` values; None for types
/// that are not fixed-width primitives.
fn compactor(data_type: &DataType, capacity: usize) -> Option<Box<dyn Compactor>> {
    macro_rules! primitive {
        ($t:ty) => {
            Some(Box::new(PrimitiveCompactor::<$t> {
                values: PooledVec::with_capacity(buffers::global(), capacity),
                data_type: data_type.clone(),
            }) as Box<dyn Compactor>)
        };
    }
    downcast_primitive! {
        data_type => (primitive),
        _ => None,
    }
}

struct PrimitiveCompactor<T: ArrowPrimitiveType> {
    values: PooledVec<T::Native>,
    data_type: DataType,
}

impl<T: ArrowPrimitiveType> Compactor for PrimitiveCompactor<T> {
    fn append(&mut self, block: &dyn Array, mask: &BooleanBuffer, kept: usize, rows_left: usize) {
        let values = block.as_primitive::<T>().values();
        let out = &mut self.values;
        if out.capacity() - out.len() < kept + compress::SLACK {
            out.reserve(rows_left + compress::SLACK);
        }
        let len = out.len();
        if let Some(written) = compress::compress_8byte(values, mask, out.spare_capacity_mut()) {
            // SAFETY: `compress_8byte` wrote the `written` items after the first `len`.
            unsafe { out.set_len(len + written) };
        } else if kept as f64 > mask.len() as f64 * RUNS_ABOVE_SELECTIVITY {
            for (start, end) in mask.set_slices() {
                out.extend_from_slice(&values[start..end]);
            }
        } else {
            out.extend(mask.set_indices().map(|i| values[i]));
        }
    }

    fn finish(self: Box<Self>, nulls: Option<NullBuffer>) -> ArrayRef {
        Arc::new(
            PrimitiveArray::<T>::new(self.values.into_scalar_buffer(), nulls)
                .with_data_type(self.data_type),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Float64Array, Int32Array, Int64Array, StringArray};
    use arrow::compute;
    use arrow::datatypes::{Field, Schema};

    use crate::expr::Literal;
    use crate::guest_api::wit::{BinaryOp, UnaryOp};

    /// 200,000 rows: six whole blocks and part of a seventh.
    const ROWS: usize = 200_000;

    fn batch() -> RecordBatch {
        let schema = Arc::new(Schema::new(vec![
            Field::new("row", DataType::Int64, false),
            Field::new("x", DataType::Float64, true),
            Field::new("small", DataType::Int32, true),
            Field::new("s", DataType::Utf8, false),
        ]));
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let x = Float64Array::from_iter((0..ROWS).map(|i| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (i % 7 != 0).then_some((state % 1000) as f64)
        }));
        let small = Int32Array::from_iter((0..ROWS).map(|i| (i % 5 != 0).then_some(i as i32)));
        let s = StringArray::from_iter_values((0..ROWS).map(|i| format!("v{i}")));
        let row = Int64Array::from_iter_values(0..ROWS as i64);
        RecordBatch::try_new(
            schema,
            vec![Arc::new(row), Arc::new(x), Arc::new(small), Arc::new(s)],
        )
        .unwrap()
    }

    fn compare(op: BinaryOp, column: &str, value: Literal) -> Expr {
        Expr::Binary {
            op,
            lhs: Arc::new(Expr::col(column)),
            rhs: Arc::new(Expr::Literal(value)),
        }
    }

    /// Arrow's filter over the mask of the whole batch: the reference.
    fn reference(batch: &RecordBatch, predicate: &Expr) -> RecordBatch {
        let mask = eval::evaluate_predicate(predicate, batch).unwrap();
        compute::filter_record_batch(batch, &mask).unwrap()
    }

    #[test]
    fn block_by_block_matches_arrows_filter_for_every_shape_of_mask() {
        let batch = batch();
        let predicates = [
            // A third kept at random, the predicate null on every seventh row.
            compare(BinaryOp::Lt, "x", Literal::Float64(333.0)),
            // Nearly all kept: copied in runs.
            compare(BinaryOp::Gt, "x", Literal::Float64(5.0)),
            compare(BinaryOp::Gt, "x", Literal::Float64(5000.0)),
            // The first block keeps nothing, then everything: the estimate is outgrown.
            compare(BinaryOp::Ge, "row", Literal::Int64(BLOCK_ROWS as i64 + 17)),
            // Only the first block keeps rows: far less than estimated.
            compare(BinaryOp::Lt, "row", Literal::Int64(BLOCK_ROWS as i64 - 3)),
            Expr::Unary {
                op: UnaryOp::IsNull,
                arg: Arc::new(Expr::col("small")),
            },
        ];
        for predicate in &predicates {
            let ours = filter(&batch, predicate).unwrap();
            assert_eq!(ours, reference(&batch, predicate), "{predicate}");
        }
        // A batch within one block, and a slice that starts mid-block.
        let predicate = &predicates[0];
        for part in [batch.slice(0, 1000), batch.slice(12_345, 100_003)] {
            assert_eq!(
                filter(&part, predicate).unwrap(),
                reference(&part, predicate)
            );
        }
    }

    #[test]
    fn an_empty_batch_still_checks_the_predicate() {
        let empty = batch().slice(0, 0);
        let fine = compare(BinaryOp::Lt, "x", Literal::Float64(1.0));
        assert_eq!(filter(&empty, &fine).unwrap().num_rows(), 0);
        let unknown = compare(BinaryOp::Lt, "fare", Literal::Float64(1.0));
        let error = filter(&empty, &unknown).unwrap_err().to_string();
        assert!(error.contains("unknown column `fare`"), "{error}");
        let not_boolean = Expr::col("x");
        let error = filter(&empty, &not_boolean).unwrap_err().to_string();
        assert!(error.contains("must be boolean"), "{error}");
    }
}
