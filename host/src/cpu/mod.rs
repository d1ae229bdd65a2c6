//! The CPU backend: expressions and table operators over Arrow arrays in host memory.
//!
//! Used when a worker has no GPU; it is also the reference the CUDA backend is tested against.

pub mod build_cache;
pub(crate) mod compare;
pub(crate) mod compress;
pub mod dictionary;
pub mod eval;
pub mod filter;
pub(crate) mod fused;
pub(crate) mod hash_index;
pub mod join;
pub(crate) mod keys;
pub mod ops;
pub mod partition;
pub mod pooled;
pub mod sort;
pub(crate) mod vector_math;

#[cfg(test)]
mod all_types {
    //! Every operator over every column type of the contract, nulls included.

    use std::sync::Arc;

    use arrow::array::{
        Array, ArrayRef, BooleanArray, Date32Array, Float32Array, Int8Array, RecordBatch,
        StringArray, TimestampMicrosecondArray, UInt32Array, UInt64Array,
    };

    use super::{join, ops, partition, sort};

    fn table() -> RecordBatch {
        let column = |a: ArrayRef| a;
        RecordBatch::try_from_iter(vec![
            (
                "flag",
                column(Arc::new(BooleanArray::from(vec![
                    Some(true),
                    None,
                    Some(false),
                    Some(true),
                ]))),
            ),
            (
                "tiny",
                column(Arc::new(Int8Array::from(vec![
                    Some(-1),
                    Some(2),
                    None,
                    Some(-1),
                ]))),
            ),
            (
                "count",
                column(Arc::new(UInt32Array::from(vec![
                    Some(7),
                    None,
                    Some(9),
                    Some(7),
                ]))),
            ),
            (
                "big",
                column(Arc::new(UInt64Array::from(vec![u64::MAX, 1, 1, u64::MAX]))),
            ),
            (
                "ratio",
                column(Arc::new(Float32Array::from(vec![
                    Some(0.5),
                    None,
                    Some(-1.5),
                    Some(0.5),
                ]))),
            ),
            (
                "name",
                column(Arc::new(StringArray::from(vec![
                    Some("a"),
                    Some("b"),
                    None,
                    Some("a"),
                ]))),
            ),
            (
                "day",
                column(Arc::new(Date32Array::from(vec![
                    Some(19_000),
                    None,
                    Some(19_001),
                    Some(19_000),
                ]))),
            ),
            (
                "at",
                column(Arc::new(TimestampMicrosecondArray::from(vec![
                    Some(5),
                    Some(3),
                    None,
                    Some(5),
                ]))),
            ),
        ])
        .unwrap()
    }

    #[test]
    fn every_operator_accepts_every_type() {
        let t = table();
        let names: Vec<String> = t
            .schema()
            .fields()
            .iter()
            .map(|f| f.name().clone())
            .collect();
        for name in &names {
            let key = std::slice::from_ref(name);
            let grouped = ops::group_by(
                &t,
                key,
                &[ops::Aggregate {
                    column: name.clone(),
                    function: ops::AggregateFn::CountDistinct,
                    alias: "n".into(),
                }],
            )
            .unwrap_or_else(|e| panic!("group-by on {name}: {e}"));
            assert!(grouped.num_rows() >= 2, "{name}");
            for descending in [false, true] {
                let keys = [sort::SortKey {
                    column: name.clone(),
                    descending,
                    nulls_first: true,
                }];
                let sorted =
                    sort::sort(&t, &keys).unwrap_or_else(|e| panic!("sort on {name}: {e}"));
                assert_eq!(sorted.num_rows(), 4);
                let first = sorted.column_by_name(name).unwrap();
                if t.column_by_name(name).unwrap().null_count() > 0 {
                    assert!(first.is_null(0), "nulls first on {name}");
                }
                assert_eq!(sort::top_k(&t, &keys, 2).unwrap().num_rows(), 2);
            }
            let parts = partition::hash_partition(&t, key, 3)
                .unwrap_or_else(|e| panic!("hash-partition on {name}: {e}"));
            assert_eq!(parts.iter().map(RecordBatch::num_rows).sum::<usize>(), 4);
            let joined = join::join(&t, &t, key, key, join::JoinType::Inner)
                .unwrap_or_else(|e| panic!("join on {name}: {e}"));
            // Rows 0 and 3 are equal in every column, so each non-null key matches itself and
            // its twin.
            let valid = t.column_by_name(name).unwrap();
            assert!(
                joined.num_rows() >= valid.len() - valid.null_count(),
                "{name}"
            );
            let distinct = ops::distinct(&t, Some(key)).unwrap();
            assert!(distinct.num_rows() < 4, "{name} has a repeated value");
        }
        assert_eq!(ops::distinct(&t, None).unwrap().num_rows(), 3);
    }
}
