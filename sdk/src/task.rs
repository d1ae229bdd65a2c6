//! The [`Task`] trait a guest implements, and [`export_task!`](crate::export_task) which
//! exports it as the component's `run`.

use std::marker::PhantomData;

use crate::bindings::{self, Guest};
use crate::error::Result;
use crate::table::Table;

/// A wrk task: it receives its input tables and returns its output tables, all as handles to
/// data held by the host.
pub trait Task {
    /// Runs the task once. An error is handed back to the host with its code and message.
    fn run(inputs: Vec<Table>) -> Result<Vec<Table>>;
}

/// Adapts a [`Task`] to the generated `Guest` trait; used by [`export_task!`](crate::export_task).
#[doc(hidden)]
pub struct TaskExport<T>(PhantomData<T>);

impl<T: Task> Guest for TaskExport<T> {
    fn run(inputs: Vec<bindings::Table>) -> Result<Vec<bindings::Table>, bindings::Error> {
        let inputs = inputs.into_iter().map(Table::from_raw).collect();
        match T::run(inputs) {
            Ok(outputs) => Ok(outputs.into_iter().map(Table::into_raw).collect()),
            Err(error) => Err(error.into()),
        }
    }
}

/// Exports a type implementing [`Task`] as this component's `run`. Use it once, in the guest
/// crate's root.
///
/// ```
/// use wrk_sdk::prelude::*;
///
/// struct PassThrough;
///
/// impl Task for PassThrough {
///     fn run(inputs: Vec<Table>) -> Result<Vec<Table>> {
///         Ok(inputs)
///     }
/// }
///
/// wrk_sdk::export_task!(PassThrough);
/// ```
#[macro_export]
macro_rules! export_task {
    ($task:ty) => {
        const _: () = {
            type __WrkTaskExport = $crate::TaskExport<$task>;
    $crate::bindings::export!(__WrkTaskExport with_types_in $crate::bindings);
        };
    };
}
