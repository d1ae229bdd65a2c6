//! The `context` interface: task identity, parameters and logging.

use super::TaskState;
use super::bindings::wrk::task::context::{Host, LogLevel};

impl Host for TaskState {
    fn job_id(&mut self) -> wasmtime::Result<String> {
        Ok(self.info.job_id.clone())
    }

    fn job_name(&mut self) -> wasmtime::Result<String> {
        Ok(self.info.job_name.clone())
    }

    fn stage_name(&mut self) -> wasmtime::Result<String> {
        Ok(self.info.stage_name.clone())
    }

    fn task_index(&mut self) -> wasmtime::Result<u32> {
        Ok(self.info.task_index)
    }

    fn task_count(&mut self) -> wasmtime::Result<u32> {
        Ok(self.info.task_count)
    }

    fn param(&mut self, name: String) -> wasmtime::Result<Option<String>> {
        Ok(self.info.params.get(&name).cloned())
    }

    fn params(&mut self) -> wasmtime::Result<Vec<(String, String)>> {
        Ok(self
            .info
            .params
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect())
    }

    fn log(&mut self, level: LogLevel, message: String) -> wasmtime::Result<()> {
        let info = &self.info;
        macro_rules! emit {
            ($level:ident) => {
                tracing::$level!(
                    target: "wrk::guest",
                    job = %info.job_name,
                    stage = %info.stage_name,
                    task = info.task_index,
                    "{message}"
                )
            };
        }
        match level {
            LogLevel::Trace => emit!(trace),
            LogLevel::Debug => emit!(debug),
            LogLevel::Info => emit!(info),
            LogLevel::Warn => emit!(warn),
            LogLevel::Error => emit!(error),
        }
        Ok(())
    }
}
