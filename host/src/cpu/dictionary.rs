//! Dictionary-encoded string columns: how they arise, and where operators see them as plain.
//!
//! A Parquet string column whose pages are all dictionary encoded is read as Arrow's
//! `Dictionary(Int32, Utf8)` (see `io`): small integer keys into the chunk's distinct values,
//! instead of every row's bytes. Gathering such a column (a join's output, a sort, a partition)
//! moves four bytes a row instead of the strings, and grouping by it hashes each distinct value
//! once. The encoding is physical only: guests, job outputs and every type check see the value
//! type ([`logical_type`]), and the operators without a dictionary path of their own read such
//! columns through [`plain`].

use std::borrow::Cow;
use std::sync::Arc;

use arrow::array::{ArrayRef, RecordBatch, RecordBatchOptions};
use arrow::compute;
use arrow::datatypes::{DataType, Field, Schema};
use arrow::error::ArrowError;

/// The type a dictionary-encoded string column is read as.
pub fn string_dictionary() -> DataType {
    DataType::Dictionary(Box::new(DataType::Int32), Box::new(DataType::Utf8))
}

/// The type a column's values have, whatever their encoding: a dictionary's value type, any
/// other type itself.
pub fn logical_type(data_type: &DataType) -> &DataType {
    match data_type {
        DataType::Dictionary(_, values) => values,
        other => other,
    }
}

/// The column with its values written out row by row (a dictionary decoded; any other column
/// as it is, without a copy).
pub fn plain(array: &ArrayRef) -> Result<ArrayRef, ArrowError> {
    match array.data_type() {
        DataType::Dictionary(_, values) => compute::cast(array, values),
        _ => Ok(array.clone()),
    }
}

/// `batch` with every dictionary-encoded column decoded (the batch itself when it has none).
pub fn plain_batch(batch: &RecordBatch) -> Result<RecordBatch, ArrowError> {
    plain_columns(batch, |_| true).map(Cow::into_owned)
}

/// `batch` with the dictionary-encoded columns that `wanted` picks (by name) decoded; borrowed
/// when there are none.
pub fn plain_columns(
    batch: &RecordBatch,
    wanted: impl Fn(&str) -> bool,
) -> Result<Cow<'_, RecordBatch>, ArrowError> {
    let schema = batch.schema();
    let decode: Vec<usize> = schema
        .fields()
        .iter()
        .enumerate()
        .filter(|(_, f)| matches!(f.data_type(), DataType::Dictionary(..)) && wanted(f.name()))
        .map(|(i, _)| i)
        .collect();
    if decode.is_empty() {
        return Ok(Cow::Borrowed(batch));
    }
    let mut fields: Vec<Arc<Field>> = schema.fields().iter().cloned().collect();
    let mut columns = batch.columns().to_vec();
    for i in decode {
        columns[i] = plain(&columns[i])?;
        fields[i] = Arc::new(
            fields[i]
                .as_ref()
                .clone()
                .with_data_type(columns[i].data_type().clone()),
        );
    }
    let schema = Arc::new(Schema::new_with_metadata(fields, schema.metadata().clone()));
    RecordBatch::try_new_with_options(
        schema,
        columns,
        &RecordBatchOptions::new().with_row_count(Some(batch.num_rows())),
    )
    .map(Cow::Owned)
}

/// Brings batches whose columns differ only in encoding to one schema: a column that is
/// dictionary encoded in some batches and plain in others (two files, one of which fell back to
/// plain pages) is decoded in all of them. `None` when the batches agree already (or differ in
/// more than encoding, which the caller reports).
pub fn unify(batches: &[&RecordBatch]) -> Result<Option<Vec<RecordBatch>>, ArrowError> {
    let Some(first) = batches.first() else {
        return Ok(None);
    };
    let schema = first.schema();
    let mut mixed = vec![false; schema.fields().len()];
    for batch in &batches[1..] {
        let other = batch.schema();
        if other.fields().len() != mixed.len() {
            return Ok(None);
        }
        for (i, (a, b)) in schema.fields().iter().zip(other.fields()).enumerate() {
            if a.data_type() != b.data_type()
                && logical_type(a.data_type()) == logical_type(b.data_type())
            {
                mixed[i] = true;
            }
        }
    }
    if !mixed.contains(&true) {
        return Ok(None);
    }
    let names: Vec<&str> = schema
        .fields()
        .iter()
        .zip(&mixed)
        .filter(|(_, m)| **m)
        .map(|(f, _)| f.name().as_str())
        .collect();
    batches
        .iter()
        .map(|b| plain_columns(b, |name| names.contains(&name)).map(Cow::into_owned))
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use arrow::array::{Array, AsArray, DictionaryArray, Int32Array, Int64Array, StringArray};
    use arrow::datatypes::Int32Type;

    /// A dictionary-encoded string column with nulls and a repeated dictionary value (which
    /// Arrow allows, and a concatenation of two dictionaries produces).
    pub(crate) fn words() -> ArrayRef {
        let keys = Int32Array::from(vec![
            Some(0),
            Some(1),
            None,
            Some(2),
            Some(0),
            Some(3),
            Some(1),
        ]);
        let values = StringArray::from(vec!["day", "night", "day", "dusk"]);
        Arc::new(DictionaryArray::<Int32Type>::try_new(keys, Arc::new(values)).unwrap())
    }

    #[test]
    fn plain_decodes_a_dictionary_and_leaves_other_columns_alone() {
        let decoded = plain(&words()).unwrap();
        let strings = decoded.as_string::<i32>();
        let got: Vec<Option<&str>> = strings.iter().collect();
        assert_eq!(
            got,
            vec![
                Some("day"),
                Some("night"),
                None,
                Some("day"),
                Some("day"),
                Some("dusk"),
                Some("night")
            ]
        );
        let ints: ArrayRef = Arc::new(Int64Array::from(vec![1, 2]));
        assert!(Arc::ptr_eq(&plain(&ints).unwrap(), &ints));
        assert_eq!(logical_type(&string_dictionary()), &DataType::Utf8);
    }

    #[test]
    fn unify_decodes_only_the_columns_whose_encodings_differ() {
        let batch = |shift: ArrayRef| {
            let n = shift.len() as i64;
            RecordBatch::try_from_iter([
                (
                    "id",
                    Arc::new(Int64Array::from_iter_values(0..n)) as ArrayRef,
                ),
                ("shift", shift),
            ])
            .unwrap()
        };
        let encoded = batch(words());
        let decoded = batch(plain(&words()).unwrap());
        assert!(unify(&[&encoded, &encoded]).unwrap().is_none());
        let unified = unify(&[&encoded, &decoded]).unwrap().unwrap();
        for b in &unified {
            assert_eq!(b.schema().field(1).data_type(), &DataType::Utf8);
            assert_eq!(b.column(1).null_count(), 1);
        }
        assert_eq!(unified[0], unified[1]);
        assert_eq!(plain_batch(&encoded).unwrap(), decoded);
    }

    /// Every operator gives the same answer over a dictionary-encoded string column as over the
    /// same column written out, as a key, a filtered column, an aggregated one and a payload.
    #[test]
    fn operators_agree_on_encoded_and_plain_strings() {
        use crate::cpu::{join, ops, partition, sort};
        use crate::expr::{Expr, Literal};
        use crate::guest_api::wit::{BinaryOp, UnaryOp};

        let table = |shift: ArrayRef| {
            let n = shift.len();
            RecordBatch::try_from_iter([
                ("shift", shift),
                (
                    "fare",
                    Arc::new(Int64Array::from_iter_values((0..n as i64).map(|i| i * 10)))
                        as ArrayRef,
                ),
            ])
            .unwrap()
        };
        let encoded = table(words());
        let decoded = table(plain(&words()).unwrap());
        assert_eq!(encoded.schema().field(0).data_type(), &string_dictionary());
        let same = |what: &str, run: &dyn Fn(&RecordBatch) -> RecordBatch| {
            let (from_encoded, from_plain) = (run(&encoded), run(&decoded));
            assert_eq!(plain_batch(&from_encoded).unwrap(), from_plain, "{what}");
        };
        let shift = || Arc::new(Expr::Column("shift".into()));
        let day = Expr::Binary {
            op: BinaryOp::Eq,
            lhs: shift(),
            rhs: Arc::new(Expr::Literal(Literal::Utf8("day".into()))),
        };
        same("filter", &|t| ops::filter(t, &day).unwrap());
        let null = Expr::Unary {
            op: UnaryOp::IsNull,
            arg: shift(),
        };
        same("is-null", &|t| ops::filter(t, &null).unwrap());
        same("with-columns", &|t| {
            ops::with_columns(t, &[("copy".into(), &Expr::Column("shift".into()))]).unwrap()
        });
        let aggregates = [
            (ops::AggregateFn::Count, "shift"),
            (ops::AggregateFn::CountDistinct, "shift"),
            (ops::AggregateFn::Max, "fare"),
            (ops::AggregateFn::Sum, "fare"),
        ]
        .map(|(function, column)| ops::Aggregate {
            column: column.into(),
            function,
            alias: format!("{function:?}"),
        });
        same("group-by", &|t| {
            ops::group_by(t, &["shift".into()], &aggregates).unwrap()
        });
        same("aggregate", &|t| ops::aggregate(t, &aggregates).unwrap());
        let by_shift = [sort::SortKey {
            column: "shift".into(),
            descending: true,
            nulls_first: false,
        }];
        same("sort", &|t| sort::sort(t, &by_shift).unwrap());
        same("top-k", &|t| sort::top_k(t, &by_shift, 3).unwrap());
        same("distinct", &|t| {
            ops::distinct(t, Some(&["shift".into()])).unwrap()
        });
        for part in 0..3 {
            same("hash-partition", &|t| {
                partition::hash_partition(t, &["shift".into()], 3).unwrap()[part].clone()
            });
        }
        let on = ["shift".to_string()];
        for how in [
            join::JoinType::Inner,
            join::JoinType::Left,
            join::JoinType::Semi,
            join::JoinType::Anti,
        ] {
            // On the encoded column against the plain one, both ways round.
            same("join", &|t| join::join(t, &decoded, &on, &on, how).unwrap());
            same("join", &|t| join::join(&decoded, t, &on, &on, how).unwrap());
        }
        // As a payload, the column stays encoded through the join's gather.
        let fares = ["fare".to_string()];
        let joined = join::join(&encoded, &encoded, &fares, &fares, join::JoinType::Inner).unwrap();
        assert!(matches!(
            joined.column(0).data_type(),
            DataType::Dictionary(..)
        ));
        same("payload", &|t| {
            join::join(t, t, &fares, &fares, join::JoinType::Inner).unwrap()
        });
        let mixed = ops::concat(&[&encoded, &decoded]).unwrap();
        assert_eq!(mixed.schema().field(0).data_type(), &DataType::Utf8);
        assert_eq!(
            mixed,
            ops::concat(&[&decoded, &decoded]).unwrap(),
            "concat of encoded and plain"
        );
        let both = ops::concat(&[&encoded, &encoded]).unwrap();
        assert_eq!(
            plain_batch(&both).unwrap(),
            ops::concat(&[&decoded, &decoded]).unwrap()
        );
    }
}
