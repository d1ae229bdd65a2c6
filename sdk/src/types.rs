//! Value-level types shared by the whole contract: column types, schema fields and scalars.

use std::fmt;

pub use crate::bindings::wrk::task::types::{DataType, Field, Scalar};

impl fmt::Display for DataType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DataType::Boolean => "boolean",
            DataType::Int8 => "int8",
            DataType::Int16 => "int16",
            DataType::Int32 => "int32",
            DataType::Int64 => "int64",
            DataType::Uint8 => "uint8",
            DataType::Uint16 => "uint16",
            DataType::Uint32 => "uint32",
            DataType::Uint64 => "uint64",
            DataType::Float32 => "float32",
            DataType::Float64 => "float64",
            DataType::Utf8 => "utf8",
            DataType::Date32 => "date32",
            DataType::TimestampUs => "timestamp-us",
        })
    }
}

macro_rules! scalar_from {
    ($($from:ty => $variant:ident as $as:ty),* $(,)?) => {$(
        impl From<$from> for Scalar {
            fn from(value: $from) -> Self {
                Scalar::$variant(<$as>::from(value))
            }
        }
    )*};
}

scalar_from! {
    bool => Boolean as bool,
    i8 => Int64 as i64,
    i16 => Int64 as i64,
    i32 => Int64 as i64,
    i64 => Int64 as i64,
    u8 => Uint64 as u64,
    u16 => Uint64 as u64,
    u32 => Uint64 as u64,
    u64 => Uint64 as u64,
    f32 => Float64 as f64,
    f64 => Float64 as f64,
    String => Utf8 as String,
    &str => Utf8 as String,
    &String => Utf8 as String,
}

/// `None` is the null scalar.
impl<T: Into<Scalar>> From<Option<T>> for Scalar {
    fn from(value: Option<T>) -> Self {
        value.map_or(Scalar::Null, Into::into)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rust_values_become_the_widest_scalar_of_their_kind() {
        assert!(matches!(Scalar::from(3_i32), Scalar::Int64(3)));
        assert!(matches!(Scalar::from(3_u8), Scalar::Uint64(3)));
        assert!(matches!(Scalar::from(1.5_f32), Scalar::Float64(v) if v == 1.5));
        assert!(matches!(Scalar::from("a"), Scalar::Utf8(s) if s == "a"));
        assert!(matches!(Scalar::from(None::<f64>), Scalar::Null));
        assert!(matches!(Scalar::from(Some(true)), Scalar::Boolean(true)));
    }

    #[test]
    fn data_types_display_as_in_the_wit() {
        assert_eq!(DataType::TimestampUs.to_string(), "timestamp-us");
        assert_eq!(DataType::Float64.to_string(), "float64");
    }
}
