//! Tenants: who may call the scheduler, identified by bearer tokens listed in a TOML file, and
//! what share of the cluster each gets.
//!
//! ```toml
//! [[tenant]]
//! name = "analytics"
//! token = "a-long-random-secret"
//! weight = 2                    # share of the cluster under contention (default 1)
//! max_tasks = 64                # tasks running (or queued on workers) at once, at most
//! max_pool_bytes = 68719476736  # bytes its held partitions may occupy in workers' pools
//!
//! [[tenant]]
//! name = "ml"
//! token_sha256 = "9f86d081884c7d65..."   # or only the token's SHA-256, to keep secrets out of files
//! ```

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

#[derive(Debug, thiserror::Error)]
pub enum TenantsError {
    #[error("cannot read the tenants file `{path}`: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the tenants file `{path}` is not valid: {detail}")]
    Invalid { path: PathBuf, detail: String },
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TenantsFile {
    #[serde(rename = "tenant", default)]
    tenants: Vec<TenantEntry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TenantEntry {
    name: String,
    token: Option<String>,
    token_sha256: Option<String>,
    weight: Option<f64>,
    max_tasks: Option<u32>,
    max_pool_bytes: Option<u64>,
}

/// A tenant's share of the cluster: see [`crate::state`]'s queue for how it is applied.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TenantPolicy {
    /// Under contention, tenants' running tasks track their weights.
    pub weight: f64,
    /// Tasks running or queued on workers at once, at most.
    pub max_tasks: Option<u32>,
    /// Bytes of its held partitions (as the scheduler accounts them) beyond which it starts no
    /// task that would only add to them.
    pub max_pool_bytes: Option<u64>,
}

impl Default for TenantPolicy {
    fn default() -> Self {
        TenantPolicy {
            weight: 1.0,
            max_tasks: None,
            max_pool_bytes: None,
        }
    }
}

/// Tenants by the SHA-256 of their token (a lookup by hash leaks nothing useful through timing),
/// and their policies by name.
#[derive(Debug, Clone, Default)]
pub struct Tenants {
    by_token_hash: HashMap<String, String>,
    policies: HashMap<String, TenantPolicy>,
}

fn sha256_hex(text: &str) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(text.as_bytes()))
}

impl Tenants {
    pub fn load(path: &Path) -> Result<Self, TenantsError> {
        let text = std::fs::read_to_string(path).map_err(|source| TenantsError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(&text, path)
    }

    /// Parses a tenants file's text; `path` names it in errors.
    pub fn parse(text: &str, path: &Path) -> Result<Self, TenantsError> {
        let invalid = |detail: String| TenantsError::Invalid {
            path: path.to_path_buf(),
            detail,
        };
        let file: TenantsFile = toml::from_str(text).map_err(|e| invalid(e.to_string()))?;
        if file.tenants.is_empty() {
            return Err(invalid("it lists no [[tenant]]".into()));
        }
        let mut by_token_hash = HashMap::new();
        let mut policies = HashMap::new();
        let mut names = std::collections::HashSet::new();
        for entry in file.tenants {
            if entry.name.is_empty() || !names.insert(entry.name.clone()) {
                return Err(invalid(format!(
                    "tenant names must be unique and not empty (`{}`)",
                    entry.name
                )));
            }
            let hash = match (entry.token, entry.token_sha256) {
                (Some(token), None) if token.len() >= 16 => sha256_hex(&token),
                (Some(_), None) => {
                    return Err(invalid(format!(
                        "tenant `{}`: a token needs at least 16 characters",
                        entry.name
                    )));
                }
                (None, Some(hash))
                    if hash.len() == 64 && hash.chars().all(|c| c.is_ascii_hexdigit()) =>
                {
                    hash.to_lowercase()
                }
                (None, Some(_)) => {
                    return Err(invalid(format!(
                        "tenant `{}`: token_sha256 must be 64 hex digits",
                        entry.name
                    )));
                }
                _ => {
                    return Err(invalid(format!(
                        "tenant `{}` needs exactly one of `token` and `token_sha256`",
                        entry.name
                    )));
                }
            };
            if by_token_hash.insert(hash, entry.name.clone()).is_some() {
                return Err(invalid(format!(
                    "tenant `{}` shares its token with another tenant",
                    entry.name
                )));
            }
            let weight = entry.weight.unwrap_or(1.0);
            if !(weight.is_finite() && weight > 0.0) {
                return Err(invalid(format!(
                    "tenant `{}`: weight must be a positive number, not {weight}",
                    entry.name
                )));
            }
            if entry.max_tasks == Some(0) || entry.max_pool_bytes == Some(0) {
                return Err(invalid(format!(
                    "tenant `{}`: max_tasks and max_pool_bytes must be at least 1 (leave them out for no limit)",
                    entry.name
                )));
            }
            policies.insert(
                entry.name,
                TenantPolicy {
                    weight,
                    max_tasks: entry.max_tasks,
                    max_pool_bytes: entry.max_pool_bytes,
                },
            );
        }
        Ok(Tenants {
            by_token_hash,
            policies,
        })
    }

    /// Every tenant's policy, by name.
    pub fn policies(&self) -> impl Iterator<Item = (&str, &TenantPolicy)> {
        self.policies.iter().map(|(name, p)| (name.as_str(), p))
    }

    /// The tenants' names.
    pub fn names(&self) -> std::collections::HashSet<String> {
        self.by_token_hash.values().cloned().collect()
    }

    /// The tenant a token belongs to.
    pub fn tenant_of(&self, token: &str) -> Option<&str> {
        self.by_token_hash
            .get(&sha256_hex(token))
            .map(String::as_str)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_and_token_hashes_identify_tenants() {
        let text = format!(
            "[[tenant]]\nname='a'\ntoken='alpha-alpha-alpha-1'\n[[tenant]]\nname='b'\ntoken_sha256='{}'\n",
            sha256_hex("bravo-bravo-bravo-2")
        );
        let tenants = Tenants::parse(&text, Path::new("t.toml")).unwrap();
        assert_eq!(tenants.tenant_of("alpha-alpha-alpha-1"), Some("a"));
        assert_eq!(tenants.tenant_of("bravo-bravo-bravo-2"), Some("b"));
        assert_eq!(tenants.tenant_of("alpha-alpha-alpha-2"), None);
    }

    #[test]
    fn bad_files_name_the_file_and_the_tenant() {
        let err = |text: &str| {
            Tenants::parse(text, Path::new("tenants.toml"))
                .unwrap_err()
                .to_string()
        };
        assert!(err("").contains("`tenants.toml`") && err("").contains("no [[tenant]]"));
        let short = err("[[tenant]]\nname='a'\ntoken='short'");
        assert!(
            short.contains("tenant `a`: a token needs at least 16 characters"),
            "{short}"
        );
        let both = err("[[tenant]]\nname='a'\n");
        assert!(both.contains("exactly one of"), "{both}");
        let shared = err(
            "[[tenant]]\nname='a'\ntoken='same-token-0123456'\n[[tenant]]\nname='b'\ntoken='same-token-0123456'",
        );
        assert!(shared.contains("tenant `b` shares its token"), "{shared}");
        let unknown = err("[[tenant]]\nname='a'\ntoken='alpha-alpha-alpha-1'\nmax_task=1");
        assert!(
            unknown.contains("`tenants.toml`") && unknown.contains("max_task"),
            "{unknown}"
        );
        let weight = err("[[tenant]]\nname='a'\ntoken='alpha-alpha-alpha-1'\nweight=0");
        assert!(
            weight.contains("tenant `a`: weight must be a positive number"),
            "{weight}"
        );
        let zero = err("[[tenant]]\nname='a'\ntoken='alpha-alpha-alpha-1'\nmax_tasks=0");
        assert!(zero.contains("tenant `a`: max_tasks"), "{zero}");
    }

    #[test]
    fn quotas_and_weights_are_read_with_defaults() {
        let text = "[[tenant]]\nname='a'\ntoken='alpha-alpha-alpha-1'\nweight=2.5\nmax_tasks=3\nmax_pool_bytes=1024\n[[tenant]]\nname='b'\ntoken='bravo-bravo-bravo-2'\n";
        let tenants = Tenants::parse(text, Path::new("t.toml")).unwrap();
        let policies: HashMap<&str, &TenantPolicy> = tenants.policies().collect();
        assert_eq!(
            *policies["a"],
            TenantPolicy {
                weight: 2.5,
                max_tasks: Some(3),
                max_pool_bytes: Some(1024),
            }
        );
        assert_eq!(*policies["b"], TenantPolicy::default());
    }
}
