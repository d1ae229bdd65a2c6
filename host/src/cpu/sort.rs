//! Sorting: a full stable sort on several keys, and top-k (the first k rows of that order found
//! with a partial sort instead of a full one).

use arrow::array::RecordBatch;
use arrow::compute::{self, SortColumn, SortOptions};

use super::ops::{OpError, column_index};

/// One sort key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SortKey {
    pub column: String,
    pub descending: bool,
    pub nulls_first: bool,
}

/// The rows ordered by `keys`.
pub fn sort(batch: &RecordBatch, keys: &[SortKey]) -> Result<RecordBatch, OpError> {
    ordered(batch, keys, None, "sort")
}

/// The first `k` rows of the order `keys` gives.
pub fn top_k(batch: &RecordBatch, keys: &[SortKey], k: u64) -> Result<RecordBatch, OpError> {
    let k = usize::try_from(k)
        .unwrap_or(usize::MAX)
        .min(batch.num_rows());
    ordered(batch, keys, Some(k), "top-k")
}

fn ordered(
    batch: &RecordBatch,
    keys: &[SortKey],
    limit: Option<usize>,
    operator: &'static str,
) -> Result<RecordBatch, OpError> {
    if keys.is_empty() {
        return Err(OpError::Invalid {
            operator,
            detail: "at least one sort key is needed".into(),
        });
    }
    let arrow = |source| OpError::Arrow { operator, source };
    let columns = keys
        .iter()
        .map(|key| {
            let index = column_index(batch, operator, &key.column)?;
            Ok(SortColumn {
                // Ordered by value, not by dictionary key.
                values: super::dictionary::plain(batch.column(index)).map_err(arrow)?,
                options: Some(SortOptions {
                    descending: key.descending,
                    nulls_first: key.nulls_first,
                }),
            })
        })
        .collect::<Result<Vec<_>, OpError>>()?;
    let indices = match columns.as_slice() {
        [single] => compute::sort_to_indices(&single.values, single.options, limit),
        _ => compute::lexsort_to_indices(&columns, limit),
    }
    .map_err(arrow)?;
    compute::take_record_batch(batch, &indices).map_err(arrow)
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{ArrayRef, AsArray, Float64Array, Int64Array, StringArray};
    use arrow::datatypes::Int64Type;
    use std::sync::Arc;

    fn batch() -> RecordBatch {
        RecordBatch::try_from_iter(vec![
            (
                "k",
                Arc::new(StringArray::from(vec![
                    Some("b"),
                    None,
                    Some("a"),
                    Some("b"),
                    Some("a"),
                ])) as ArrayRef,
            ),
            (
                "x",
                Arc::new(Float64Array::from(vec![
                    Some(1.0),
                    Some(5.0),
                    None,
                    Some(3.0),
                    Some(2.0),
                ])) as ArrayRef,
            ),
            (
                "id",
                Arc::new(Int64Array::from(vec![0, 1, 2, 3, 4])) as ArrayRef,
            ),
        ])
        .unwrap()
    }

    fn key(column: &str, descending: bool, nulls_first: bool) -> SortKey {
        SortKey {
            column: column.into(),
            descending,
            nulls_first,
        }
    }

    fn ids(batch: &RecordBatch) -> Vec<i64> {
        batch
            .column_by_name("id")
            .unwrap()
            .as_primitive::<Int64Type>()
            .values()
            .to_vec()
    }

    #[test]
    fn several_keys_with_directions_and_null_placement() {
        let out = sort(&batch(), &[key("k", false, false), key("x", true, true)]).unwrap();
        // a: x null (nulls first), then 2.0; b: 3.0 then 1.0; the null key last.
        assert_eq!(ids(&out), [2, 4, 3, 0, 1]);
        let out = sort(&batch(), &[key("k", true, true)]).unwrap();
        assert_eq!(ids(&out)[0], 1);
    }

    #[test]
    fn top_k_matches_the_head_of_the_full_sort() {
        for keys in [
            vec![key("x", true, false)],
            vec![key("k", false, true), key("x", false, false)],
        ] {
            let full = sort(&batch(), &keys).unwrap();
            for k in 0..=6 {
                let top = top_k(&batch(), &keys, k).unwrap();
                assert_eq!(ids(&top), ids(&full)[..(k as usize).min(5)]);
            }
        }
    }

    #[test]
    fn unknown_sort_column_is_named() {
        let err = sort(&batch(), &[key("y", false, false)])
            .unwrap_err()
            .to_string();
        assert!(err.contains("`y`") && err.contains("sort"), "{err}");
    }
}
