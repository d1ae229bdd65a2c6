//! Checks of a `WrkCluster` spec that its schema cannot express, done before anything is
//! rendered; a failure shows in the cluster's status as `Ready=False, reason InvalidSpec`.

use std::collections::BTreeSet;

use crate::crd::{GPU_RESOURCE, WrkClusterSpec};
use crate::render::worker;

/// Prefix of NVIDIA's MIG slice resources (`nvidia.com/mig-1g.5gb`).
pub const MIG_PREFIX: &str = "nvidia.com/mig-";

/// Longest cluster name: `NAME-scheduler` must be a DNS label (63) for its Service.
pub const MAX_CLUSTER_NAME: usize = 63 - "-scheduler".len();

fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && s.as_bytes()[0].is_ascii_lowercase()
        && !s.ends_with('-')
}

fn is_dns_subdomain(s: &str) -> bool {
    s.len() <= 253 && s.split('.').all(is_dns_label_loose)
}

/// A DNS label that may start with a digit (RFC 1123, as object names allow).
fn is_dns_label_loose(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

fn is_secret_key(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s != "."
        && s != ".."
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
}

/// Whether `resource` is one the operator gives each worker one of.
pub fn is_gpu_resource(resource: &str) -> bool {
    resource == GPU_RESOURCE
        || resource.strip_prefix(MIG_PREFIX).is_some_and(|profile| {
            !profile.is_empty()
                && profile
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'-')
        })
}

/// Every problem of `spec` for a cluster called `name`, one message each.
pub fn cluster(name: &str, spec: &WrkClusterSpec) -> Result<(), Vec<String>> {
    let mut problems = Vec::new();
    if !is_dns_label(name) || name.len() > MAX_CLUSTER_NAME {
        problems.push(format!(
            "cluster name `{name}` must be a DNS label (lower-case letters, digits, '-', starting \
             with a letter) of at most {MAX_CLUSTER_NAME} characters"
        ));
    }
    if spec.image.trim().is_empty() {
        problems.push("`image` is empty".to_string());
    }
    if spec.worker_groups.is_empty() {
        problems.push("`workerGroups` is empty".to_string());
    }
    if let Some(auth) = &spec.auth {
        if !is_dns_subdomain(&auth.secret_name) {
            problems.push(format!(
                "auth.secretName `{}` is not a valid Secret name",
                auth.secret_name
            ));
        }
        for (field, key) in [
            ("tenantsKey", &auth.tenants_key),
            ("workerTokenKey", &auth.worker_token_key),
            ("clientTokenKey", &auth.client_token_key),
        ] {
            if !is_secret_key(key) {
                problems.push(format!(
                    "auth.{field} `{key}` is not a valid Secret key (letters, digits, '-', '_', '.')"
                ));
            }
        }
    }
    let mut seen = BTreeSet::new();
    for group in &spec.worker_groups {
        let g = &group.name;
        if !is_dns_label(g) || name.len() + g.len() + 7 > 63 {
            problems.push(format!(
                "worker group `{g}`: its name must be a DNS label, short enough that \
                 `{name}-{g}-NNNNN` stays within 63 characters"
            ));
        }
        if !seen.insert(g.as_str()) {
            problems.push(format!("worker group `{g}` is named twice"));
        }
        if !is_gpu_resource(&group.gpu.resource) {
            problems.push(format!(
                "worker group `{g}`: gpu.resource `{}` is neither `{GPU_RESOURCE}` nor a MIG \
                 slice `{MIG_PREFIX}<profile>`",
                group.gpu.resource
            ));
        }
        if !(group.pool_fraction > 0.0 && group.pool_fraction < 1.0) {
            problems.push(format!(
                "worker group `{g}`: poolFraction {} is not between 0 and 1",
                group.pool_fraction
            ));
        }
        if let Some(a) = group.autoscaling
            && a.min_replicas > a.max_replicas
        {
            problems.push(format!(
                "worker group `{g}`: autoscaling.minReplicas {} exceeds maxReplicas {}",
                a.min_replicas, a.max_replicas
            ));
        }
        match worker::sizing(group) {
            Ok(size) if size.memory_limit_bytes == 0 => {
                problems.push(format!("worker group `{g}`: the memory limit is zero"));
            }
            Ok(_) => {}
            Err(e) => problems.push(format!("worker group `{g}`: {e}")),
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::AutoscalingSpec;
    use crate::render::testing;

    #[test]
    fn accepts_gpu_and_mig_groups() {
        let c = testing::cluster(vec![
            testing::group("a100", 2, "nvidia.com/gpu"),
            testing::group("mig", 7, "nvidia.com/mig-1g.5gb"),
        ]);
        assert_eq!(cluster("demo", &c.spec), Ok(()));
    }

    #[test]
    fn reports_every_problem() {
        let mut bad = testing::group("a100", 2, "nvidia.com/mig-");
        bad.pool_fraction = 1.5;
        bad.autoscaling = Some(AutoscalingSpec {
            min_replicas: 5,
            max_replicas: 2,
        });
        let dup = testing::group("a100", 1, "amd.com/gpu");
        let c = testing::cluster(vec![bad, dup]);
        let problems = cluster("Demo", &c.spec).unwrap_err();
        let text = problems.join("\n");
        assert!(text.contains("cluster name `Demo`"), "{text}");
        assert!(text.contains("named twice"), "{text}");
        assert!(text.contains("`nvidia.com/mig-`"), "{text}");
        assert!(text.contains("`amd.com/gpu`"), "{text}");
        assert!(text.contains("poolFraction 1.5"), "{text}");
        assert!(
            text.contains("minReplicas 5 exceeds maxReplicas 2"),
            "{text}"
        );
    }

    #[test]
    fn auth_names_a_valid_secret_and_keys() {
        let mut c = testing::cluster(vec![testing::group("a100", 1, "nvidia.com/gpu")]);
        c.spec.auth = Some(testing::auth("demo-tokens"));
        assert_eq!(cluster("demo", &c.spec), Ok(()));
        let mut bad = testing::auth("Demo_Tokens");
        bad.client_token_key = "a/b".to_string();
        c.spec.auth = Some(bad);
        let text = cluster("demo", &c.spec).unwrap_err().join("\n");
        assert!(text.contains("auth.secretName `Demo_Tokens`"), "{text}");
        assert!(text.contains("auth.clientTokenKey `a/b`"), "{text}");
    }

    #[test]
    fn long_names_are_rejected() {
        let c = testing::cluster(vec![testing::group(&"g".repeat(40), 1, "nvidia.com/gpu")]);
        assert!(cluster(&"c".repeat(20), &c.spec).is_err());
        assert!(cluster(&"c".repeat(54), &testing::cluster(vec![]).spec).is_err());
    }

    #[test]
    fn gpu_resources() {
        assert!(is_gpu_resource("nvidia.com/gpu"));
        assert!(is_gpu_resource("nvidia.com/mig-3g.20gb"));
        assert!(!is_gpu_resource("nvidia.com/mig-"));
        assert!(!is_gpu_resource("nvidia.com/mig-1g 5gb"));
        assert!(!is_gpu_resource("cpu"));
    }
}
