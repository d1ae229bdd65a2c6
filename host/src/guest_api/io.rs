//! The `io` interface: Parquet reads and writes, only on the sources and sinks the job granted.

use wasmtime::component::Resource;

use super::bindings::wrk::task::io::{Host, ReadOptions};
use super::wit::{Error, ErrorCode};
use super::{ExprHandle, TaskState, TaskTable, error};

fn granted<'a>(
    grants: &'a std::collections::BTreeMap<String, String>,
    kind: &str,
    name: &str,
) -> Result<&'a str, Error> {
    grants.get(name).map(String::as_str).ok_or_else(|| {
        let names: Vec<&str> = grants.keys().map(String::as_str).collect();
        error(
            ErrorCode::Io,
            format!(
                "{kind} `{name}` is not granted to this job (granted {kind}s: {})",
                if names.is_empty() {
                    "none".to_string()
                } else {
                    names.join(", ")
                }
            ),
        )
    })
}

/// An object name a task may use: no path separators, no dot-dot, not empty.
fn valid_object_name(name: &str) -> Result<(), Error> {
    let ok = !name.is_empty()
        && name.len() <= 200
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && !name.starts_with('.');
    if ok {
        Ok(())
    } else {
        Err(error(
            ErrorCode::InvalidArgument,
            format!("invalid output name `{name}`: use letters, digits, `-`, `_` and `.`"),
        ))
    }
}

impl Host for TaskState {
    fn sources(&mut self) -> wasmtime::Result<Vec<String>> {
        Ok(self.info.sources.keys().cloned().collect())
    }

    fn sinks(&mut self) -> wasmtime::Result<Vec<String>> {
        Ok(self.info.sinks.keys().cloned().collect())
    }

    fn read_parquet(
        &mut self,
        source: String,
        options: ReadOptions,
    ) -> wasmtime::Result<Result<Resource<TaskTable>, Error>> {
        let uri = match granted(&self.info.sources, "source", &source) {
            Ok(uri) => uri.to_string(),
            Err(e) => return Ok(Err(e)),
        };
        let columns = options.columns.unwrap_or_default();
        match crate::io::read_source(&uri, &columns, options.row_groups.as_deref(), None) {
            Ok(batch) => self.push_table(batch),
            Err(e) => Ok(Err(error(ErrorCode::Io, format!("source `{source}`: {e}")))),
        }
    }

    fn read_parquet_where(
        &mut self,
        source: String,
        options: ReadOptions,
        predicate: Resource<ExprHandle>,
    ) -> wasmtime::Result<Result<Resource<TaskTable>, Error>> {
        let uri = match granted(&self.info.sources, "source", &source) {
            Ok(uri) => uri.to_string(),
            Err(e) => return Ok(Err(e)),
        };
        let predicate = self.table.get(&predicate)?.0.clone();
        let columns = options.columns.unwrap_or_default();
        let rows = options.row_groups.as_deref();
        match crate::io::read_source(&uri, &columns, rows, Some(&predicate)) {
            Ok(batch) => self.push_table(batch),
            Err(e) => Ok(Err(error(ErrorCode::Io, format!("source `{source}`: {e}")))),
        }
    }

    fn write_parquet(
        &mut self,
        sink: String,
        name: String,
        data: Resource<TaskTable>,
    ) -> wasmtime::Result<Result<String, Error>> {
        let uri = match granted(&self.info.sinks, "sink", &sink) {
            Ok(uri) => uri.to_string(),
            Err(e) => return Ok(Err(e)),
        };
        if let Err(e) = valid_object_name(&name) {
            return Ok(Err(e));
        }
        let object = format!(
            "{}-{:05}-{name}",
            self.info.stage_name, self.info.task_index
        );
        let table = match self.host_input(&data, "write-parquet")? {
            Ok(table) => table,
            Err(e) => return Ok(Err(e)),
        };
        match crate::io::write_table(&uri, &object, table.batch()) {
            Ok(location) => Ok(Ok(location)),
            Err(e) => Ok(Err(error(ErrorCode::Io, format!("sink `{sink}`: {e}")))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn object_names_cannot_escape_the_sink() {
        assert!(valid_object_name("part.0").is_ok());
        for bad in ["", "../x", "a/b", ".hidden", "a b"] {
            assert!(valid_object_name(bad).is_err(), "{bad:?} must be rejected");
        }
    }

    #[test]
    fn ungranted_source_lists_the_granted_ones() {
        let mut grants = std::collections::BTreeMap::new();
        grants.insert("trips".to_string(), "/data".to_string());
        let err = granted(&grants, "source", "secrets").unwrap_err();
        assert!(
            err.message.contains("`secrets` is not granted"),
            "{}",
            err.message
        );
        assert!(err.message.contains("trips"), "{}", err.message);
    }
}
