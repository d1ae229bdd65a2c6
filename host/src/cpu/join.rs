//! Hash join of two tables (inner, left, semi, anti) on one or several key columns.
//!
//! The hash index ([`super::hash_index`]) is built on the smaller table and probed with the
//! other, unless the caller names a shared table to build on: then the index comes from the
//! worker's [`BuildCache`], built once and probed by every task joining with that table. Null
//! keys never match. Matching rows of one key keep their table order.

use std::collections::HashSet;
use std::sync::Arc;

use arrow::array::{Array, ArrayRef, BooleanBufferBuilder, RecordBatch, UInt32Array};
use arrow::buffer::NullBuffer;
use arrow::compute;
use arrow::datatypes::{Field, Schema};

use super::build_cache::BuildCache;
use super::hash_index::{END, HashIndex};
use super::keys::{EncodedKeys, key_types};
use super::ops::{OpError, column_index};

const OP: &str = "join";

/// Which rows a join keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JoinType {
    Inner,
    Left,
    Semi,
    Anti,
}

/// One of a join's two tables.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Left,
    Right,
}

/// Where a join's hash index comes from.
#[derive(Debug, Clone, Copy)]
pub enum Build<'a> {
    /// Built on the smaller table for this join alone.
    Smaller,
    /// Built on `side`, a table the worker's tasks share: taken from `cache`, or built and
    /// cached there.
    Shared { side: Side, cache: &'a BuildCache },
}

/// Joins `left` with `right` on `left_on[i] = right_on[i]`, building on the smaller table.
pub fn join(
    left: &RecordBatch,
    right: &RecordBatch,
    left_on: &[String],
    right_on: &[String],
    how: JoinType,
) -> Result<RecordBatch, OpError> {
    join_with(left, right, left_on, right_on, how, Build::Smaller)
}

/// Joins `left` with `right` on `left_on[i] = right_on[i]`, with the index `build` says.
pub fn join_with(
    left: &RecordBatch,
    right: &RecordBatch,
    left_on: &[String],
    right_on: &[String],
    how: JoinType,
    build: Build<'_>,
) -> Result<RecordBatch, OpError> {
    if left_on.is_empty() || left_on.len() != right_on.len() {
        return Err(OpError::Invalid {
            operator: OP,
            detail: format!(
                "needs the same number (at least one) of left and right keys, got {} and {}",
                left_on.len(),
                right_on.len()
            ),
        });
    }
    let key_columns = |batch: &RecordBatch, names: &[String]| {
        names
            .iter()
            .map(|n| column_index(batch, OP, n).map(|i| batch.column(i).clone()))
            .collect::<Result<Vec<ArrayRef>, _>>()
    };
    let (left_keys, right_keys) = (key_columns(left, left_on)?, key_columns(right, right_on)?);
    let invalid = |detail: String| OpError::Invalid {
        operator: OP,
        detail: format!(
            "joining ({}) with ({}): {detail}",
            left_on.join(", "),
            right_on.join(", ")
        ),
    };
    let types = key_types(&left_keys, &right_keys).map_err(invalid)?;
    let encode = |keys: &[ArrayRef]| {
        EncodedKeys::encode_as(keys, &types).map_err(|e| invalid(e.to_string()))
    };
    let build_left = match build {
        Build::Smaller => left.num_rows() < right.num_rows(),
        Build::Shared { side, .. } => side == Side::Left,
    };
    let (build_keys, probe_keys) = if build_left {
        (&left_keys, &right_keys)
    } else {
        (&right_keys, &left_keys)
    };
    let build_index = || HashIndex::build(encode(build_keys)?).map_err(|e| invalid(e.to_string()));
    let index = match build {
        Build::Smaller => Arc::new(build_index()?),
        Build::Shared { cache, .. } => cache.get_or_build(build_keys, &types, build_index)?,
    };
    let probe = encode(probe_keys)?;

    match how {
        JoinType::Semi | JoinType::Anti => {
            let keep = matched_left_rows(&index, &probe, build_left, left.num_rows());
            let wanted = how == JoinType::Semi;
            let indices: UInt32Array = (0..left.num_rows() as u32)
                .filter(|&r| keep[r as usize] == wanted)
                .collect();
            compute::take_record_batch(left, &indices).map_err(|source| OpError::Arrow {
                operator: OP,
                source,
            })
        }
        JoinType::Inner | JoinType::Left => {
            let pairs = pairs(&index, &probe, build_left, how, left.num_rows());
            assemble(left, right, right_on, &pairs)
        }
    }
}

/// For each left row, whether some right row matches it.
fn matched_left_rows(
    index: &HashIndex,
    probe: &EncodedKeys,
    build_left: bool,
    left_rows: usize,
) -> Vec<bool> {
    if build_left {
        let mut matched = vec![false; left_rows];
        index.probe(probe, |_, mut build_row| {
            while build_row != END {
                matched[build_row as usize] = true;
                build_row = index.next(build_row);
            }
        });
        matched
    } else {
        let mut matched = Vec::with_capacity(left_rows);
        index.probe(probe, |_, first| matched.push(first != END));
        matched
    }
}

/// The rows of an inner or left join: which left row and which right row each output row
/// comes from.
struct Pairs {
    /// `None` when the output's left rows are exactly the left table's, in order.
    left: Option<UInt32Array>,
    /// A left join's unmatched left rows pair with a null right row.
    right: UInt32Array,
}

fn pairs(
    index: &HashIndex,
    probe: &EncodedKeys,
    build_left: bool,
    how: JoinType,
    left_rows: usize,
) -> Pairs {
    let mut left_out: Vec<u32> = Vec::with_capacity(probe.len());
    let mut right_out: Vec<u32> = Vec::with_capacity(probe.len());
    // Which right rows are real (a left join's unmatched rows are not).
    let mut valid = (how == JoinType::Left).then(|| BooleanBufferBuilder::new(probe.len()));
    if build_left {
        let mut matched = vec![false; if how == JoinType::Left { left_rows } else { 0 }];
        index.probe(probe, |row, mut build_row| {
            while build_row != END {
                left_out.push(build_row);
                right_out.push(row as u32);
                if let Some(m) = matched.get_mut(build_row as usize) {
                    *m = true;
                }
                build_row = index.next(build_row);
            }
        });
        if let Some(valid) = &mut valid {
            valid.append_n(right_out.len(), true);
        }
        for (row, _) in matched.iter().enumerate().filter(|(_, m)| !**m) {
            left_out.push(row as u32);
            right_out.push(0);
            if let Some(valid) = &mut valid {
                valid.append(false);
            }
        }
        return Pairs {
            left: Some(UInt32Array::from(left_out)),
            right: UInt32Array::new(
                right_out.into(),
                valid.map(|mut v| NullBuffer::new(v.finish())),
            ),
        };
    }
    // Probing with the left table: its rows come out in order, each once unless a key
    // repeats or (inner join) has no match.
    let chains = index.has_chains();
    let mut identity = true;
    index.probe(probe, |row, first| {
        if first == END {
            if let Some(valid) = &mut valid {
                left_out.push(row as u32);
                right_out.push(0);
                valid.append(false);
            } else {
                identity = false;
            }
            return;
        }
        left_out.push(row as u32);
        right_out.push(first);
        if let Some(valid) = &mut valid {
            valid.append(true);
        }
        if chains {
            let mut build_row = index.next(first);
            while build_row != END {
                identity = false;
                left_out.push(row as u32);
                right_out.push(build_row);
                if let Some(valid) = &mut valid {
                    valid.append(true);
                }
                build_row = index.next(build_row);
            }
        }
    });
    Pairs {
        left: (!identity).then(|| UInt32Array::from(left_out)),
        right: UInt32Array::new(
            right_out.into(),
            valid.map(|mut v| NullBuffer::new(v.finish())),
        ),
    }
}

/// The joined table: the left columns, then the right columns except its keys (renamed with
/// `_right` when their name is taken).
fn assemble(
    left: &RecordBatch,
    right: &RecordBatch,
    right_on: &[String],
    pairs: &Pairs,
) -> Result<RecordBatch, OpError> {
    let arrow = |source| OpError::Arrow {
        operator: OP,
        source,
    };
    let mut fields: Vec<Arc<Field>> = left.schema().fields().iter().cloned().collect();
    let mut columns: Vec<ArrayRef> = match &pairs.left {
        Some(left_rows) => left
            .columns()
            .iter()
            .map(|c| compute::take(c, left_rows, None))
            .collect::<Result<_, _>>()
            .map_err(arrow)?,
        // Every left row once, in order: the columns as they are.
        None => left.columns().to_vec(),
    };
    let right_rows = &pairs.right;
    let mut taken: HashSet<String> = fields.iter().map(|f| f.name().clone()).collect();
    let right_schema = right.schema();
    let right_has_nulls = right_rows.null_count() > 0;
    for (field, column) in right_schema.fields().iter().zip(right.columns()) {
        if right_on.contains(field.name()) {
            continue;
        }
        let mut name = field.name().clone();
        while taken.contains(&name) {
            name.push_str("_right");
        }
        taken.insert(name.clone());
        fields.push(Arc::new(
            field
                .as_ref()
                .clone()
                .with_name(name)
                .with_nullable(field.is_nullable() || right_has_nulls),
        ));
        columns.push(compute::take(column, right_rows, None).map_err(arrow)?);
    }
    RecordBatch::try_new(Arc::new(Schema::new(fields)), columns).map_err(arrow)
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{AsArray, Int32Array, Int64Array, StringArray};
    use arrow::datatypes::{DataType, Int64Type};

    fn trips() -> RecordBatch {
        RecordBatch::try_from_iter(vec![
            (
                "zone",
                Arc::new(Int64Array::from(vec![
                    Some(1),
                    Some(2),
                    None,
                    Some(9),
                    Some(1),
                ])) as ArrayRef,
            ),
            (
                "fare",
                Arc::new(Int64Array::from(vec![10, 20, 30, 40, 50])) as ArrayRef,
            ),
        ])
        .unwrap()
    }

    fn zones() -> RecordBatch {
        RecordBatch::try_from_iter(vec![
            (
                "id",
                Arc::new(Int32Array::from(vec![Some(2), Some(1), None])) as ArrayRef,
            ),
            (
                "name",
                Arc::new(StringArray::from(vec!["two", "one", "none"])) as ArrayRef,
            ),
            (
                "fare",
                Arc::new(Int64Array::from(vec![200, 100, 0])) as ArrayRef,
            ),
        ])
        .unwrap()
    }

    fn keys(names: &[&str]) -> Vec<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    fn ints(batch: &RecordBatch, name: &str) -> Vec<Option<i64>> {
        let column = compute::cast(batch.column_by_name(name).unwrap(), &DataType::Int64).unwrap();
        column.as_primitive::<Int64Type>().iter().collect()
    }

    #[test]
    fn every_join_type_with_either_build_side() {
        for (left, right, left_key, right_key) in [
            (trips(), zones(), "zone", "id"),
            (zones(), trips(), "id", "zone"),
        ] {
            let inner = join(
                &left,
                &right,
                &keys(&[left_key]),
                &keys(&[right_key]),
                JoinType::Inner,
            )
            .unwrap();
            assert_eq!(inner.num_rows(), 3, "null keys never match");
            let left_join = join(
                &left,
                &right,
                &keys(&[left_key]),
                &keys(&[right_key]),
                JoinType::Left,
            )
            .unwrap();
            assert_eq!(
                left_join.num_rows(),
                inner.num_rows() + left.num_rows() - matched(&left, &inner, left_key)
            );
            let semi = join(
                &left,
                &right,
                &keys(&[left_key]),
                &keys(&[right_key]),
                JoinType::Semi,
            )
            .unwrap();
            let anti = join(
                &left,
                &right,
                &keys(&[left_key]),
                &keys(&[right_key]),
                JoinType::Anti,
            )
            .unwrap();
            assert_eq!(semi.num_rows() + anti.num_rows(), left.num_rows());
            assert_eq!(semi.schema(), left.schema());
        }
    }

    /// How many distinct left rows the inner join matched (keys are unique on one side here).
    fn matched(left: &RecordBatch, inner: &RecordBatch, key: &str) -> usize {
        let inner_keys: HashSet<Option<i64>> = ints(inner, key).into_iter().collect();
        ints(left, key)
            .iter()
            .filter(|k| inner_keys.contains(k))
            .count()
    }

    #[test]
    fn inner_join_values_and_column_names() {
        let out = join(
            &trips(),
            &zones(),
            &keys(&["zone"]),
            &keys(&["id"]),
            JoinType::Inner,
        )
        .unwrap();
        let names: Vec<String> = out
            .schema()
            .fields()
            .iter()
            .map(|f| f.name().clone())
            .collect();
        assert_eq!(names, ["zone", "fare", "name", "fare_right"]);
        assert_eq!(ints(&out, "zone"), [Some(1), Some(2), Some(1)]);
        assert_eq!(ints(&out, "fare_right"), [Some(100), Some(200), Some(100)]);
        let left = join(
            &trips(),
            &zones(),
            &keys(&["zone"]),
            &keys(&["id"]),
            JoinType::Left,
        )
        .unwrap();
        let names = left.column_by_name("name").unwrap().as_string::<i32>();
        assert_eq!(
            names.iter().collect::<Vec<_>>(),
            [Some("one"), Some("two"), None, None, Some("one")]
        );
    }

    #[test]
    fn multi_key_and_string_keys() {
        let out = join(
            &zones(),
            &zones(),
            &keys(&["id", "name"]),
            &keys(&["id", "name"]),
            JoinType::Inner,
        )
        .unwrap();
        assert_eq!(out.num_rows(), 2, "the row with a null id never matches");
        let err = join(
            &trips(),
            &zones(),
            &keys(&["zone"]),
            &keys(&["name"]),
            JoinType::Inner,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("Int64") && err.contains("Utf8"), "{err}");
        let err = join(
            &trips(),
            &zones(),
            &keys(&["zone"]),
            &keys(&["nope"]),
            JoinType::Inner,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("`nope`"), "{err}");
    }

    /// `batch` with its column `name` replaced by `key(column)`.
    fn rekeyed(
        batch: &RecordBatch,
        name: &str,
        key: impl Fn(&ArrayRef) -> ArrayRef,
    ) -> RecordBatch {
        let i = batch.schema().index_of(name).unwrap();
        let mut columns = batch.columns().to_vec();
        columns[i] = key(&columns[i]);
        let mut fields: Vec<Field> = batch
            .schema()
            .fields()
            .iter()
            .map(|f| f.as_ref().clone())
            .collect();
        fields[i] = Field::new(name, columns[i].data_type().clone(), true);
        RecordBatch::try_new(Arc::new(Schema::new(fields)), columns).unwrap()
    }

    #[test]
    fn every_index_layout_gives_the_same_rows() {
        // Small integers index a table by value; spread out, they hash; as strings, they take
        // the row format. Duplicate keys on the build side chain.
        let spread = |a: &ArrayRef| -> ArrayRef {
            let wide = compute::cast(a, &DataType::Int64).unwrap();
            let wide = wide.as_primitive::<Int64Type>();
            Arc::new(wide.unary::<_, Int64Type>(|v| v.wrapping_mul(1_000_000_007_000)))
        };
        let text = |a: &ArrayRef| compute::cast(a, &DataType::Utf8).unwrap();
        let payload = |batch: &RecordBatch| {
            batch
                .columns()
                .iter()
                .zip(batch.schema().fields())
                .filter(|(_, f)| f.name().starts_with("fare"))
                .map(|(c, _)| c.clone())
                .collect::<Vec<_>>()
        };
        for (left, right, left_key, right_key) in [
            (trips(), zones(), "zone", "id"),
            (zones(), trips(), "id", "zone"),
            (trips(), trips(), "zone", "zone"),
        ] {
            for how in [
                JoinType::Inner,
                JoinType::Left,
                JoinType::Semi,
                JoinType::Anti,
            ] {
                let on = (keys(&[left_key]), keys(&[right_key]));
                let expected = join(&left, &right, &on.0, &on.1, how).unwrap();
                for change in [&spread as &dyn Fn(&ArrayRef) -> ArrayRef, &text] {
                    let (l, r) = (
                        rekeyed(&left, left_key, change),
                        rekeyed(&right, right_key, change),
                    );
                    let out = join(&l, &r, &on.0, &on.1, how).unwrap();
                    assert_eq!(payload(&out), payload(&expected), "{how:?} on {left_key}");
                }
            }
        }
    }

    #[test]
    fn duplicate_keys_give_every_pair() {
        let left = trips();
        let out = join(
            &left,
            &left,
            &keys(&["zone"]),
            &keys(&["zone"]),
            JoinType::Inner,
        )
        .unwrap();
        // zone 1 twice -> 4 pairs, zone 2 and 9 once each.
        assert_eq!(out.num_rows(), 6);
        assert!(out.column(0).null_count() == 0);
    }
}
