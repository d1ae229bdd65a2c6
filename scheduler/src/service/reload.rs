//! Reloading the tenants file while the scheduler runs: it is read again when its text changes
//! (polled, which also follows a Kubernetes Secret or ConfigMap update), so tenants can be added,
//! given new tokens or removed without a restart. A removed tenant's datasets are released. A
//! file that no longer parses is reported and the tenants so far stay in force.

use std::sync::Arc;
use std::time::Duration;

use super::{SchedulerService, send};
use crate::tenants::Tenants;

/// How often the tenants file is looked at.
const RELOAD_EVERY: Duration = Duration::from_secs(2);

impl SchedulerService {
    /// Polls the tenants file, when the scheduler has one, until the service is dropped.
    pub(super) fn spawn_tenants_reload(&self) -> Option<tokio::task::JoinHandle<()>> {
        let path = self.config.tenants_file.clone()?;
        let service = self.clone();
        Some(tokio::spawn(async move {
            let mut last = std::fs::read_to_string(&path).ok();
            let mut tick = tokio::time::interval(RELOAD_EVERY);
            loop {
                tick.tick().await;
                service.reload_tenants(&path, &mut last);
            }
        }))
    }

    /// Reads the tenants file again if its text differs from `last`: installs the new tenants
    /// and releases the datasets of tenants it no longer lists.
    fn reload_tenants(&self, path: &std::path::Path, last: &mut Option<String>) {
        let text = match std::fs::read_to_string(path) {
            Ok(text) => text,
            Err(e) => {
                if last.take().is_some() {
                    tracing::warn!(
                        "cannot read the tenants file `{}` ({e}); keeping the tenants loaded before",
                        path.display()
                    );
                }
                return;
            }
        };
        if last.as_deref() == Some(text.as_str()) {
            return;
        }
        *last = Some(text.clone());
        let tenants = match Tenants::parse(&text, path) {
            Ok(tenants) => tenants,
            Err(e) => {
                tracing::warn!("{e}; keeping the tenants loaded before");
                return;
            }
        };
        let names = tenants.names();
        *self
            .tenants
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(Arc::new(tenants));
        tracing::info!(
            tenants = names.len(),
            "reloaded the tenants file `{}`",
            path.display()
        );
        send(self.state().release_datasets_except(&names));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SchedulerConfig;
    use tonic::Request;
    use wrk_proto::{JobSpec, Stage};

    const A: &str = "a-token-of-sixteen-chars";
    const B: &str = "b-token-of-sixteen-chars";

    fn file(tenants: &[(&str, &str)]) -> String {
        tenants
            .iter()
            .map(|(name, token)| format!("[[tenant]]\nname = \"{name}\"\ntoken = \"{token}\"\n"))
            .collect()
    }

    fn request(token: &str) -> Request<()> {
        let mut request = Request::new(());
        request.metadata_mut().insert(
            "authorization",
            format!("Bearer {token}").parse().expect("a header value"),
        );
        request
    }

    #[test]
    fn a_tenant_removed_from_the_file_loses_access_and_its_datasets() {
        let dir = std::env::temp_dir().join(format!("wrk-reload-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tenants.toml");
        let both = file(&[("a", A), ("b", B)]);
        std::fs::write(&path, &both).unwrap();
        let service = SchedulerService::new(SchedulerConfig {
            tenants: Some(Arc::new(Tenants::parse(&both, &path).unwrap())),
            tenants_file: Some(path.clone()),
            ..Default::default()
        });
        for tenant in ["a", "b"] {
            let mut spec = JobSpec {
                name: "make".into(),
                persist: format!("{tenant}-data"),
                stages: vec![Stage {
                    name: "make".into(),
                    module_hash: "h".into(),
                    num_tasks: 1,
                    ..Default::default()
                }],
                ..Default::default()
            };
            let mut state = service.state();
            let reads = state.resolve_datasets(tenant, &mut spec).unwrap();
            let (id, _) = state.submit(tenant, spec);
            state
                .register_datasets(tenant, &id, reads, &format!("{tenant}-data"))
                .unwrap();
        }

        let mut last = Some(both);
        // Unchanged text: nothing happens.
        service.reload_tenants(&path, &mut last);
        assert_eq!(service.state().datasets("b").datasets.len(), 1);
        // Unparseable text: the tenants so far stay.
        std::fs::write(&path, "[[tenant]]\nname = \"a\"\n").unwrap();
        service.reload_tenants(&path, &mut last);
        assert_eq!(service.tenant(&request(B)).unwrap(), "b");

        std::fs::write(&path, file(&[("a", A)])).unwrap();
        service.reload_tenants(&path, &mut last);
        assert_eq!(service.tenant(&request(A)).unwrap(), "a");
        assert!(service.tenant(&request(B)).is_err(), "b's token is refused");
        assert!(service.state().datasets("b").datasets.is_empty());
        assert_eq!(service.state().datasets("a").datasets.len(), 1);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
