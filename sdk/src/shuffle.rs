//! Peer-to-peer exchanges between stages: a mapper sends hash-partitions of its tables to the
//! reducers of a named exchange, and each reducer receives its own partition as one table
//! ([`receive`]) or piece by piece ([`receive_pieces`], for partitions larger than the worker's
//! memory pool).
//!
//! The job declares the exchange on the reducer stage's input
//! (`inputs = [{ stage = "map", exchange = "by-key" }]`); the pieces travel straight from the
//! mappers' workers to the reducers' workers.
//!
//! ```no_run
//! use wrk_sdk::prelude::*;
//!
//! fn map(trips: &Table) -> Result<()> {
//!     // Combine before the shuffle: one row per driver leaves this task, not one per trip.
//!     let partial = trips.group_by(["driver_id"]).agg([sum("fare_amount")])?;
//!     shuffle::send("by-driver", &partial, ["driver_id"])
//! }
//!
//! fn reduce() -> Result<Table> {
//!     shuffle::receive("by-driver")?
//!         .group_by(["driver_id"])
//!         .agg([sum("fare_amount_sum").alias("fare")])
//! }
//! # fn main() {}
//! ```

use crate::bindings::wrk::task::shuffle as raw;
use crate::error::Result;
use crate::table::Table;

/// Exchanges this task sends to, as a mapper.
pub fn outgoing() -> Vec<String> {
    raw::outgoing()
}

/// The partition (reducer) count of an exchange this task sends to.
pub fn partitions(exchange: &str) -> Result<u32> {
    Ok(raw::partitions(exchange)?)
}

/// Splits `table` by the hash of `keys` (the hash of [`Table::hash_partition`]) into the
/// exchange's partitions and sends each piece to its reducer. A mapper may send several times;
/// the task ends only after every piece arrived.
pub fn send<S: AsRef<str>>(
    exchange: &str,
    table: &Table,
    keys: impl IntoIterator<Item = S>,
) -> Result<()> {
    let keys: Vec<String> = keys.into_iter().map(|k| k.as_ref().to_owned()).collect();
    Ok(raw::send(exchange, table.as_raw(), &keys)?)
}

/// Sends partitions the task made itself: `parts[i]` goes to reducer i.
pub fn send_partitions(exchange: &str, parts: Vec<Table>) -> Result<()> {
    let parts: Vec<_> = parts.into_iter().map(Table::into_raw).collect();
    Ok(raw::send_partitions(exchange, parts)?)
}

/// This reducer's partition of an exchange: every mapper's pieces, concatenated in mapper order.
/// The whole partition must fit in the worker's memory pool at once.
pub fn receive(exchange: &str) -> Result<Table> {
    Ok(Table::from_raw(raw::receive(exchange)?))
}

/// This reducer's partition of an exchange, one piece at a time (in [`receive`]'s order, at
/// least one per mapper, possibly empty). Pieces wait in the worker's pool, spilled under
/// pressure, and each comes back only when taken: fold them to handle a partition larger than
/// the pool.
///
/// ```no_run
/// use wrk_sdk::prelude::*;
///
/// fn reduce() -> Result<Table> {
///     let mut total: Option<Table> = None;
///     for piece in shuffle::receive_pieces("by-driver")? {
///         let piece = piece?;
///         let both = match total.take() {
///             Some(total) => Table::concat([&total, &piece])?,
///             None => piece,
///         };
///         total = Some(both.group_by(["driver_id"]).agg([sum("fare").alias("fare")])?);
///     }
///     total.ok_or_else(|| Error::msg("no pieces"))
/// }
/// # fn main() {}
/// ```
pub fn receive_pieces(exchange: &str) -> Result<Pieces> {
    Ok(Pieces(raw::receive_pieces(exchange)?))
}

/// The pieces of a reducer's partition; see [`receive_pieces`].
pub struct Pieces(raw::Pieces);

impl Iterator for Pieces {
    type Item = Result<Table>;

    fn next(&mut self) -> Option<Result<Table>> {
        match self.0.next() {
            Ok(Some(piece)) => Some(Ok(Table::from_raw(piece))),
            Ok(None) => None,
            Err(e) => Some(Err(e.into())),
        }
    }
}
