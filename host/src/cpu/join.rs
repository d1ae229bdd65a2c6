//! Hash join of two tables (inner, left, semi, anti) on one or several key columns.
//!
//! The hash table is built on the smaller table and probed with the other; null keys never
//! match. Matching rows of one key keep their table order.

use std::collections::HashSet;
use std::sync::Arc;

use arrow::array::{Array, ArrayRef, RecordBatch, UInt32Array};
use arrow::compute;
use arrow::datatypes::{Field, Schema};
use hashbrown::HashMap;

use super::keys::EncodedKeys;
use super::ops::{OpError, column_index};

const OP: &str = "join";

/// Marks the end of a chain of build rows with equal keys.
const END: u32 = u32::MAX;

/// Which rows a join keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JoinType {
    Inner,
    Left,
    Semi,
    Anti,
}

/// The build side's rows by key: `heads` maps a key to its first row, `next` links each row to
/// the next one with the same key.
struct BuildTable<'a> {
    heads: Heads<'a>,
    next: Vec<u32>,
}

enum Heads<'a> {
    Int(HashMap<i64, u32>),
    Rows(HashMap<&'a [u8], u32>),
}

impl<'a> BuildTable<'a> {
    fn new(keys: &'a EncodedKeys) -> Self {
        let rows = keys.len();
        let mut next = vec![END; rows];
        // Inserting from the last row makes every chain run in table order.
        let heads = match keys {
            EncodedKeys::Int(values) => {
                let mut heads = HashMap::with_capacity(rows);
                for row in (0..rows).rev().filter(|&r| !keys.is_null(r)) {
                    if let Some(previous) = heads.insert(values.value(row), row as u32) {
                        next[row] = previous;
                    }
                }
                Heads::Int(heads)
            }
            EncodedKeys::Rows { rows: encoded, .. } => {
                let mut heads = HashMap::with_capacity(rows);
                for row in (0..rows).rev().filter(|&r| !keys.is_null(r)) {
                    if let Some(previous) = heads.insert(encoded.row(row).data(), row as u32) {
                        next[row] = previous;
                    }
                }
                Heads::Rows(heads)
            }
        };
        BuildTable { heads, next }
    }

    /// The first build row whose key equals the probe's row `row`, or `END`.
    fn first_match(&self, probe: &EncodedKeys, row: usize) -> u32 {
        if probe.is_null(row) {
            return END;
        }
        let found = match (&self.heads, probe) {
            (Heads::Int(heads), EncodedKeys::Int(values)) => heads.get(&values.value(row)),
            (Heads::Rows(heads), EncodedKeys::Rows { rows, .. }) => heads.get(rows.row(row).data()),
            // `encode_pair` gives both sides the same encoding.
            _ => None,
        };
        found.copied().unwrap_or(END)
    }

    /// Every build row matching the probe's row `row`, in build-table order.
    fn matches(&self, probe: &EncodedKeys, row: usize) -> impl Iterator<Item = u32> + '_ {
        let first = self.first_match(probe, row);
        std::iter::successors((first != END).then_some(first), |&r| {
            let next = self.next[r as usize];
            (next != END).then_some(next)
        })
    }
}

/// Joins `left` with `right` on `left_on[i] = right_on[i]`.
pub fn join(
    left: &RecordBatch,
    right: &RecordBatch,
    left_on: &[String],
    right_on: &[String],
    how: JoinType,
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
    let (left_encoded, right_encoded) =
        EncodedKeys::encode_pair(&left_keys, &right_keys).map_err(|detail| OpError::Invalid {
            operator: OP,
            detail: format!(
                "joining ({}) with ({}): {detail}",
                left_on.join(", "),
                right_on.join(", ")
            ),
        })?;

    let build_left = left.num_rows() < right.num_rows();
    let (build, probe) = if build_left {
        (&left_encoded, &right_encoded)
    } else {
        (&right_encoded, &left_encoded)
    };
    let table = BuildTable::new(build);

    match how {
        JoinType::Semi | JoinType::Anti => {
            let keep = matched_left_rows(&table, probe, build_left, left.num_rows());
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
            let (left_rows, right_rows) = pairs(&table, probe, build_left, how, left.num_rows());
            assemble(left, right, right_on, &left_rows, &right_rows)
        }
    }
}

/// For each left row, whether some right row matches it.
fn matched_left_rows(
    table: &BuildTable<'_>,
    probe: &EncodedKeys,
    build_left: bool,
    left_rows: usize,
) -> Vec<bool> {
    if build_left {
        let mut matched = vec![false; left_rows];
        for row in 0..probe.len() {
            for build_row in table.matches(probe, row) {
                matched[build_row as usize] = true;
            }
        }
        matched
    } else {
        (0..left_rows)
            .map(|row| table.first_match(probe, row) != END)
            .collect()
    }
}

/// The (left row, right row) pairs of an inner or left join; a left join's unmatched left rows
/// pair with a null right row.
fn pairs(
    table: &BuildTable<'_>,
    probe: &EncodedKeys,
    build_left: bool,
    how: JoinType,
    left_rows: usize,
) -> (UInt32Array, UInt32Array) {
    let mut left_out: Vec<u32> = Vec::with_capacity(probe.len());
    let mut right_out: Vec<Option<u32>> = Vec::with_capacity(probe.len());
    if build_left {
        let mut matched = vec![false; if how == JoinType::Left { left_rows } else { 0 }];
        for row in 0..probe.len() {
            for build_row in table.matches(probe, row) {
                left_out.push(build_row);
                right_out.push(Some(row as u32));
                if let Some(m) = matched.get_mut(build_row as usize) {
                    *m = true;
                }
            }
        }
        for (row, _) in matched.iter().enumerate().filter(|(_, m)| !**m) {
            left_out.push(row as u32);
            right_out.push(None);
        }
    } else {
        for row in 0..probe.len() {
            let mut any = false;
            for build_row in table.matches(probe, row) {
                left_out.push(row as u32);
                right_out.push(Some(build_row));
                any = true;
            }
            if !any && how == JoinType::Left {
                left_out.push(row as u32);
                right_out.push(None);
            }
        }
    }
    (UInt32Array::from(left_out), UInt32Array::from(right_out))
}

/// The joined table: the left columns, then the right columns except its keys (renamed with
/// `_right` when their name is taken).
fn assemble(
    left: &RecordBatch,
    right: &RecordBatch,
    right_on: &[String],
    left_rows: &UInt32Array,
    right_rows: &UInt32Array,
) -> Result<RecordBatch, OpError> {
    let arrow = |source| OpError::Arrow {
        operator: OP,
        source,
    };
    let mut fields: Vec<Arc<Field>> = left.schema().fields().iter().cloned().collect();
    let mut columns: Vec<ArrayRef> = left
        .columns()
        .iter()
        .map(|c| compute::take(c, left_rows, None))
        .collect::<Result<_, _>>()
        .map_err(arrow)?;
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
