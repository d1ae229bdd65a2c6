//! Comparisons of a primitive column with a literal (`fare > 30.0`), bit-packed into a mask.
//!
//! Arrow's comparison kernel gives the same answer, but it orders floats totally (`-0.0 < 0.0`,
//! NaN above every number), which is a 64-bit integer comparison per value: x86-64's baseline
//! (SSE2) has none, so the kernel compares one value at a time. The loop here is the same
//! generic code compiled a second time with AVX2 (chosen at run time), whose 64-bit integer
//! comparison lets the compiler compare four values per instruction.

use arrow::array::{Array, ArrowPrimitiveType, AsArray, BooleanArray, downcast_primitive};
use arrow::buffer::{BooleanBuffer, MutableBuffer};
use arrow::datatypes::{ArrowNativeTypeOp, DataType};

use crate::guest_api::wit::BinaryOp;

/// `column op scalar` (or `scalar op column` when `scalar_first`), where `scalar` is a
/// one-row array of the column's type: the mask, null where the column is null. None when
/// this kernel does not apply (not a primitive type, another operator, or a null scalar).
pub fn compare_with_scalar(
    op: BinaryOp,
    column: &dyn Array,
    scalar: &dyn Array,
    scalar_first: bool,
) -> Option<BooleanArray> {
    if column.data_type() != scalar.data_type() || scalar.len() != 1 || scalar.is_null(0) {
        return None;
    }
    // `5 < x` is `x > 5`.
    let op = match (op, scalar_first) {
        (op, false) => op,
        (BinaryOp::Lt, true) => BinaryOp::Gt,
        (BinaryOp::Le, true) => BinaryOp::Ge,
        (BinaryOp::Gt, true) => BinaryOp::Lt,
        (BinaryOp::Ge, true) => BinaryOp::Le,
        (op, true) => op,
    };
    macro_rules! primitive {
        ($t:ty) => {
            compare_primitive::<$t>(op, column, scalar)
        };
    }
    downcast_primitive! {
        column.data_type() => (primitive),
        _ => None,
    }
}

fn compare_primitive<T: ArrowPrimitiveType>(
    op: BinaryOp,
    column: &dyn Array,
    scalar: &dyn Array,
) -> Option<BooleanArray> {
    let column = column.as_primitive::<T>();
    let scalar = scalar.as_primitive::<T>();
    let bits = match T::DATA_TYPE {
        // Floats compare as integers whose order is the floats' total order.
        DataType::Float64 => compare_keys(
            op,
            column.values().inner().typed_data::<i64>(),
            scalar.values().inner().typed_data::<i64>()[0],
            |bits| bits ^ (((bits >> 63) as u64) >> 1) as i64,
        ),
        DataType::Float32 => compare_keys(
            op,
            column.values().inner().typed_data::<i32>(),
            scalar.values().inner().typed_data::<i32>()[0],
            |bits| bits ^ (((bits >> 31) as u32) >> 1) as i32,
        ),
        DataType::Float16 => return None,
        _ => compare_keys(op, column.values(), scalar.value(0), |v| v),
    }?;
    Some(BooleanArray::new(bits, column.nulls().cloned()))
}

/// The mask of `key(value) op key(scalar)` over `values`.
fn compare_keys<V, K>(
    op: BinaryOp,
    values: &[V],
    scalar: V,
    key: impl Fn(V) -> K + Copy,
) -> Option<BooleanBuffer>
where
    V: Copy,
    K: ArrowNativeTypeOp,
{
    let s = key(scalar);
    Some(match op {
        BinaryOp::Eq => pack(values, move |v| key(v).is_eq(s)),
        BinaryOp::Ne => pack(values, move |v| key(v).is_ne(s)),
        BinaryOp::Lt => pack(values, move |v| key(v).is_lt(s)),
        BinaryOp::Le => pack(values, move |v| key(v).is_le(s)),
        BinaryOp::Gt => pack(values, move |v| key(v).is_gt(s)),
        BinaryOp::Ge => pack(values, move |v| key(v).is_ge(s)),
        _ => return None,
    })
}

/// The mask of the values for which `keep` holds, with AVX2 when the CPU has it.
fn pack<T: Copy, F: Fn(T) -> bool>(values: &[T], keep: F) -> BooleanBuffer {
    let mut words = MutableBuffer::new(values.len().div_ceil(64) * 8);
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2, checked just above.
        unsafe { pack_avx2(values, &keep, &mut words) };
        return BooleanBuffer::new(words.into(), 0, values.len());
    }
    pack_words(values, &keep, &mut words);
    BooleanBuffer::new(words.into(), 0, values.len())
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn pack_avx2<T: Copy, F: Fn(T) -> bool>(values: &[T], keep: &F, words: &mut MutableBuffer) {
    pack_words(values, keep, words)
}

#[inline(always)]
fn pack_words<T: Copy, F: Fn(T) -> bool>(values: &[T], keep: &F, words: &mut MutableBuffer) {
    // Whole words apart from the tail, so that the compiler sees 64 values a word.
    let chunks = values.chunks_exact(64);
    let rest = chunks.remainder();
    for chunk in chunks {
        words.push(pack_word(chunk, keep));
    }
    if !rest.is_empty() {
        words.push(pack_word(rest, keep));
    }
}

/// The bits of up to 64 values.
#[inline(always)]
fn pack_word<T: Copy, F: Fn(T) -> bool>(values: &[T], keep: &F) -> u64 {
    let mut word = 0u64;
    for (i, &v) in values.iter().enumerate() {
        word |= u64::from(keep(v)) << i;
    }
    word
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow::array::{ArrayRef, Float64Array, Int32Array, UInt64Array};
    use arrow::compute::kernels::cmp;

    use super::*;

    const OPS: [BinaryOp; 6] = [
        BinaryOp::Eq,
        BinaryOp::Ne,
        BinaryOp::Lt,
        BinaryOp::Le,
        BinaryOp::Gt,
        BinaryOp::Ge,
    ];

    fn arrow_compare(
        op: BinaryOp,
        l: &dyn arrow::array::Datum,
        r: &dyn arrow::array::Datum,
    ) -> BooleanArray {
        match op {
            BinaryOp::Eq => cmp::eq(l, r),
            BinaryOp::Ne => cmp::neq(l, r),
            BinaryOp::Lt => cmp::lt(l, r),
            BinaryOp::Le => cmp::lt_eq(l, r),
            BinaryOp::Gt => cmp::gt(l, r),
            _ => cmp::gt_eq(l, r),
        }
        .unwrap()
    }

    /// Every operator, both ways round, against Arrow's kernel.
    fn agrees_with_arrow(column: ArrayRef, scalars: &[ArrayRef]) {
        for scalar in scalars {
            let datum = arrow::array::Scalar::new(scalar.clone());
            for op in OPS {
                let ours =
                    compare_with_scalar(op, column.as_ref(), scalar.as_ref(), false).unwrap();
                assert_eq!(
                    ours,
                    arrow_compare(op, &column, &datum),
                    "{op:?} {scalar:?}"
                );
                let ours = compare_with_scalar(op, column.as_ref(), scalar.as_ref(), true).unwrap();
                assert_eq!(
                    ours,
                    arrow_compare(op, &datum, &column),
                    "{scalar:?} {op:?}"
                );
            }
        }
    }

    #[test]
    fn floats_compare_in_total_order_like_arrow() {
        let mut values = vec![
            Some(f64::NAN),
            Some(-f64::NAN),
            Some(0.0),
            Some(-0.0),
            Some(f64::INFINITY),
            Some(f64::NEG_INFINITY),
            None,
            Some(30.0),
            Some(30.000000000000004),
        ];
        values.extend((0..1000).map(|i| Some(f64::from(i) * 0.37 - 100.0)));
        let column: ArrayRef = Arc::new(Float64Array::from(values));
        let scalars: Vec<ArrayRef> = [30.0, 0.0, -0.0, f64::NAN, f64::INFINITY, -50.5]
            .iter()
            .map(|&v| Arc::new(Float64Array::from(vec![v])) as ArrayRef)
            .collect();
        agrees_with_arrow(column.clone(), &scalars);
        // A slice that starts mid-word.
        agrees_with_arrow(column.slice(7, 900), &scalars);
    }

    #[test]
    fn integers_compare_like_arrow() {
        let column: ArrayRef = Arc::new(Int32Array::from_iter(
            (0..777).map(|i| (i % 13 != 0).then_some(i - 300)),
        ));
        let scalars: Vec<ArrayRef> = [0, -300, 476, i32::MIN]
            .iter()
            .map(|&v| Arc::new(Int32Array::from(vec![v])) as ArrayRef)
            .collect();
        agrees_with_arrow(column, &scalars);
        let column: ArrayRef = Arc::new(UInt64Array::from_iter_values(0..130));
        agrees_with_arrow(column, &[Arc::new(UInt64Array::from(vec![u64::MAX - 1]))]);
    }

    #[test]
    fn other_cases_are_left_to_arrow() {
        let column: ArrayRef = Arc::new(Int32Array::from(vec![1, 2]));
        let null: ArrayRef = Arc::new(Int32Array::from(vec![None]));
        let other_type: ArrayRef = Arc::new(Float64Array::from(vec![1.0]));
        assert!(compare_with_scalar(BinaryOp::Gt, column.as_ref(), null.as_ref(), false).is_none());
        assert!(
            compare_with_scalar(BinaryOp::Gt, column.as_ref(), other_type.as_ref(), false)
                .is_none()
        );
        assert!(
            compare_with_scalar(BinaryOp::Add, column.as_ref(), column.as_ref(), false).is_none()
        );
    }
}
