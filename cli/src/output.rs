//! Presenting results: concatenating result tables, printing them, writing them to Parquet.

use std::path::Path;

use anyhow::{Context, Result};
use arrow::record_batch::RecordBatch;
use wrk_host::table::Table;

/// The tables as one batch (they must share a schema); `None` when there are none.
pub fn combine(tables: &[Table]) -> Result<Option<RecordBatch>> {
    if tables.is_empty() {
        return Ok(None);
    }
    let batches: Vec<&RecordBatch> = tables.iter().map(Table::batch).collect();
    Ok(Some(wrk_host::cpu::ops::concat(&batches).context(
        "the job's result tables do not share a schema",
    )?))
}

/// Prints up to `max_rows` rows as a table.
pub fn print(batch: &RecordBatch, max_rows: usize) -> Result<()> {
    let shown = batch.slice(0, batch.num_rows().min(max_rows));
    println!("{}", arrow::util::pretty::pretty_format_batches(&[shown])?);
    if batch.num_rows() > max_rows {
        println!("({} of {} rows shown)", max_rows, batch.num_rows());
    }
    Ok(())
}

pub fn write_parquet(path: &Path, batch: &RecordBatch) -> Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("cannot create `{}`", dir.display()))?;
    }
    wrk_host::io::write_file(path, std::slice::from_ref(batch), 1 << 20)?;
    Ok(())
}
