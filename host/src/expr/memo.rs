//! Memos over one expression tree for the compilers that walk it node by node (the CPU fused
//! program and the GPU kernel generator): each node's structural identity, so that equal
//! subtrees share one register without being rendered to text, and each node's type, inferred
//! once. Without them a compiler re-renders and re-types every subtree at every node above it,
//! which costs more than the kernel launch it prepares.

use std::collections::HashMap;
use std::marker::PhantomData;

use arrow::datatypes::{DataType, Schema};

use super::{Expr, ExprError, Literal};

/// The memos of one tree borrowed for `'t` (node addresses are stable while it is borrowed).
pub(crate) struct TreeMemo<'t> {
    schema: &'t Schema,
    ids: HashMap<*const Expr, usize>,
    structures: HashMap<String, usize>,
    types: HashMap<*const Expr, Result<DataType, ExprError>>,
    tree: PhantomData<&'t Expr>,
}

impl<'t> TreeMemo<'t> {
    pub(crate) fn new(schema: &'t Schema) -> Self {
        TreeMemo {
            schema,
            ids: HashMap::new(),
            structures: HashMap::new(),
            types: HashMap::new(),
            tree: PhantomData,
        }
    }

    /// A number equal for equal subtrees (literals equal to the bit) and different otherwise,
    /// computed once per node from its operator and its operands' numbers.
    pub(crate) fn id(&mut self, expr: &'t Expr) -> usize {
        let address = expr as *const Expr;
        if let Some(&id) = self.ids.get(&address) {
            return id;
        }
        let structure = match expr {
            Expr::Column(name) => format!("column {name}"),
            Expr::Literal(Literal::Float64(v)) => format!("f64 {:#x}", v.to_bits()),
            Expr::Literal(literal) => format!("literal {literal:?}"),
            Expr::Binary { op, lhs, rhs } => {
                let (lhs, rhs) = (self.id(lhs), self.id(rhs));
                format!("binary {op:?} {lhs} {rhs}")
            }
            Expr::Unary { op, arg } => format!("unary {op:?} {}", self.id(arg)),
            Expr::Cast { arg, to } => format!("cast {to:?} {}", self.id(arg)),
            Expr::FillNull { arg, fill } => {
                let (arg, fill) = (self.id(arg), self.id(fill));
                format!("fill_null {arg} {fill}")
            }
            Expr::IfElse {
                condition,
                then,
                otherwise,
            } => {
                let (c, t, o) = (self.id(condition), self.id(then), self.id(otherwise));
                format!("if_else {c} {t} {o}")
            }
        };
        let next = self.structures.len();
        let id = *self.structures.entry(structure).or_insert(next);
        self.ids.insert(address, id);
        id
    }

    /// [`Expr::data_type`] of `expr`, inferred on the first call for this node.
    pub(crate) fn data_type(&mut self, expr: &'t Expr) -> Result<DataType, ExprError> {
        let schema = self.schema;
        self.types
            .entry(expr as *const Expr)
            .or_insert_with(|| expr.data_type(schema))
            .clone()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow::datatypes::Field;

    use super::*;
    use crate::guest_api::wit::BinaryOp;

    fn add(lhs: Expr, rhs: Expr) -> Expr {
        Expr::Binary {
            op: BinaryOp::Add,
            lhs: Arc::new(lhs),
            rhs: Arc::new(rhs),
        }
    }

    #[test]
    fn equal_subtrees_built_apart_share_a_number_and_different_ones_do_not() {
        let schema = Schema::new(vec![Field::new("a", DataType::Float64, true)]);
        let one = Expr::Literal(Literal::Float64(1.0));
        let tree = [
            add(Expr::col("a"), one.clone()),
            add(Expr::col("a"), one.clone()),
            add(one.clone(), Expr::col("a")),
            add(Expr::col("a"), Expr::Literal(Literal::Int64(1))),
            add(Expr::col("a"), Expr::Literal(Literal::Float64(-0.0))),
            add(Expr::col("a"), Expr::Literal(Literal::Float64(0.0))),
        ];
        let mut memo = TreeMemo::new(&schema);
        let ids: Vec<usize> = tree.iter().map(|e| memo.id(e)).collect();
        assert_eq!(ids[0], ids[1]);
        for (i, a) in ids.iter().enumerate().skip(1) {
            for b in &ids[i + 1..] {
                assert_ne!(a, b, "{ids:?}");
            }
        }
        assert_eq!(memo.data_type(&tree[3]), Ok(DataType::Float64));
        let unknown = add(Expr::col("b"), one);
        assert!(matches!(
            memo.data_type(&unknown),
            Err(ExprError::UnknownColumn { .. })
        ));
    }
}
