//! One column of a table, held by the host, and the explicit copies of its values into and out
//! of the guest.

use crate::bindings::wrk::task::dataframe::Column as RawColumn;
pub use crate::bindings::wrk::task::dataframe::{ColumnValues, Values};
use crate::error::{Error, ErrorCode, Result};

/// A handle to one column (an Arrow array) held by the host.
#[derive(Debug)]
pub struct Column(RawColumn);

impl Column {
    /// Wraps a raw column handle.
    pub fn from_raw(raw: RawColumn) -> Self {
        Self(raw)
    }

    /// The raw column handle.
    pub fn as_raw(&self) -> &RawColumn {
        &self.0
    }

    /// Unwraps the raw column handle.
    pub fn into_raw(self) -> RawColumn {
        self.0
    }

    /// The column's name.
    pub fn name(&self) -> String {
        self.0.name()
    }

    /// The column's logical type.
    pub fn data_type(&self) -> crate::types::DataType {
        self.0.data_type()
    }

    /// The number of values, nulls included.
    pub fn len(&self) -> u64 {
        self.0.len()
    }

    /// Whether the column has no values.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The number of null values.
    pub fn null_count(&self) -> u64 {
        self.0.null_count()
    }

    /// The same data under another name.
    pub fn rename(&self, name: &str) -> Column {
        Column(self.0.rename(name))
    }

    /// Copies the column's values into the guest (a copy counted in the task's statistics).
    ///
    /// Integer columns arrive as `int64` or `uint64`, floats as `float64`, dates and timestamps
    /// as `int64`.
    pub fn to_values(&self) -> Result<ColumnValues> {
        Ok(self.0.to_values()?)
    }

    /// Copies a float column into the guest. Fails on other types (cast them to `float64`
    /// first) and on nulls (fill them first, or use [`Column::to_values`]).
    pub fn to_f64_vec(&self) -> Result<Vec<f64>> {
        f64s(&self.name(), self.to_values()?)
    }

    /// Copies an integer, date or timestamp column into the guest. Fails on other types, on
    /// unsigned values above `i64::MAX`, and on nulls.
    pub fn to_i64_vec(&self) -> Result<Vec<i64>> {
        i64s(&self.name(), self.to_values()?)
    }

    /// Copies a `utf8` column into the guest. Fails on other types and on nulls.
    pub fn to_strings(&self) -> Result<Vec<String>> {
        strings(&self.name(), self.to_values()?)
    }

    /// Copies guest values into a new host column (a copy counted in the task's statistics).
    pub fn from_values(name: &str, values: ColumnValues) -> Result<Column> {
        Ok(Column(RawColumn::from_values(name, &values)?))
    }

    /// A new `float64` column without nulls.
    pub fn from_f64s(name: &str, values: &[f64]) -> Result<Column> {
        Self::from_values(name, non_null(Values::Float64(values.to_vec())))
    }

    /// A new `int64` column without nulls.
    pub fn from_i64s(name: &str, values: &[i64]) -> Result<Column> {
        Self::from_values(name, non_null(Values::Int64(values.to_vec())))
    }

    /// A new `utf8` column without nulls.
    pub fn from_strings<S: AsRef<str>>(name: &str, values: &[S]) -> Result<Column> {
        let values = values.iter().map(|s| s.as_ref().to_owned()).collect();
        Self::from_values(name, non_null(Values::Utf8(values)))
    }
}

fn non_null(values: Values) -> ColumnValues {
    ColumnValues {
        values,
        validity: None,
    }
}

/// The name the host's delivery of `values` goes by, for error messages.
fn kind(values: &Values) -> &'static str {
    match values {
        Values::Boolean(_) => "boolean",
        Values::Int64(_) => "int64",
        Values::Uint64(_) => "uint64",
        Values::Float64(_) => "float64",
        Values::Utf8(_) => "utf8",
    }
}

/// The values of a column without nulls, or an error naming the column.
fn without_nulls(column: &str, values: ColumnValues) -> Result<Values> {
    let nulls = values
        .validity
        .as_ref()
        .map_or(0, |valid| valid.iter().filter(|v| !**v).count());
    if nulls > 0 {
        return Err(Error::new(
            ErrorCode::InvalidArgument,
            format!(
                "column `{column}` has {nulls} null value(s); fill them with `fill_null` or read \
                 them with `to_values`"
            ),
        ));
    }
    Ok(values.values)
}

fn type_mismatch(column: &str, found: &Values, wanted: &str) -> Error {
    Error::new(
        ErrorCode::TypeMismatch,
        format!(
            "column `{column}` holds {} values, not {wanted}",
            kind(found)
        ),
    )
}

fn f64s(column: &str, values: ColumnValues) -> Result<Vec<f64>> {
    match without_nulls(column, values)? {
        Values::Float64(v) => Ok(v),
        other => Err(type_mismatch(
            column,
            &other,
            "float64 (cast it with `.cast(DataType::Float64)`)",
        )),
    }
}

fn i64s(column: &str, values: ColumnValues) -> Result<Vec<i64>> {
    match without_nulls(column, values)? {
        Values::Int64(v) => Ok(v),
        Values::Uint64(v) => v
            .into_iter()
            .map(|x| {
                i64::try_from(x).map_err(|_| {
                    Error::new(
                        ErrorCode::InvalidArgument,
                        format!("column `{column}` holds {x}, which does not fit in an i64"),
                    )
                })
            })
            .collect(),
        other => Err(type_mismatch(column, &other, "integers")),
    }
}

fn strings(column: &str, values: ColumnValues) -> Result<Vec<String>> {
    match without_nulls(column, values)? {
        Values::Utf8(v) => Ok(v),
        other => Err(type_mismatch(column, &other, "utf8")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_validity(values: Values, validity: Vec<bool>) -> ColumnValues {
        ColumnValues {
            values,
            validity: Some(validity),
        }
    }

    #[test]
    fn typed_copies_accept_their_own_type() {
        assert_eq!(
            f64s("x", non_null(Values::Float64(vec![1.0, 2.5]))),
            Ok(vec![1.0, 2.5])
        );
        assert_eq!(i64s("x", non_null(Values::Int64(vec![-1]))), Ok(vec![-1]));
        assert_eq!(i64s("x", non_null(Values::Uint64(vec![7]))), Ok(vec![7]));
        assert_eq!(
            strings("x", non_null(Values::Utf8(vec!["a".into()]))),
            Ok(vec!["a".to_owned()])
        );
    }

    #[test]
    fn a_validity_without_nulls_is_fine() {
        let values = with_validity(Values::Float64(vec![1.0]), vec![true]);
        assert_eq!(f64s("x", values), Ok(vec![1.0]));
    }

    #[test]
    fn nulls_are_refused_with_the_count() {
        let values = with_validity(
            Values::Float64(vec![1.0, 0.0, 0.0]),
            vec![true, false, false],
        );
        let error = f64s("fare", values).unwrap_err();
        assert_eq!(error.code(), ErrorCode::InvalidArgument);
        assert!(error.message().contains("`fare` has 2 null"), "{error}");
    }

    #[test]
    fn other_types_are_refused_naming_both_types() {
        let error = f64s("n", non_null(Values::Int64(vec![1]))).unwrap_err();
        assert_eq!(error.code(), ErrorCode::TypeMismatch);
        assert!(
            error
                .message()
                .contains("`n` holds int64 values, not float64"),
            "{error}"
        );
        let error = strings("n", non_null(Values::Boolean(vec![true]))).unwrap_err();
        assert!(
            error.message().contains("holds boolean values, not utf8"),
            "{error}"
        );
    }

    #[test]
    fn unsigned_values_beyond_i64_are_refused() {
        let error = i64s("big", non_null(Values::Uint64(vec![u64::MAX]))).unwrap_err();
        assert!(error.message().contains(&u64::MAX.to_string()), "{error}");
    }
}
