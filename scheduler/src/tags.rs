//! Worker tags: what a worker offers (`wrk worker --tags gpu,h100`, plus automatic ones from its
//! device) and a stage may require (`requires = ["gpu"]`); a task runs only on a worker having
//! every tag its stage requires, as Dask's worker resources do.

use wrk_proto::GpuInfo;

/// Why a tag was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TagError {
    #[error("a tag may not be empty")]
    Empty,
    #[error("tag `{0}` has characters other than a-z, 0-9, `.`, `_`, `:` and `-`")]
    Invalid(String),
}

fn allowed(c: char) -> bool {
    c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '.' | '_' | ':' | '-')
}

/// Checks that `tag` is non-empty and made of `a-z 0-9 . _ : -`.
pub fn check(tag: &str) -> Result<(), TagError> {
    if tag.is_empty() {
        Err(TagError::Empty)
    } else if !tag.chars().all(allowed) {
        Err(TagError::Invalid(tag.to_string()))
    } else {
        Ok(())
    }
}

/// A device name as a tag: lower case, every run of other characters one `-`
/// ("NVIDIA H100 80GB HBM3" is `nvidia-h100-80gb-hbm3`).
fn as_tag(name: &str) -> String {
    let mut tag = String::with_capacity(name.len());
    for c in name.trim().chars().flat_map(char::to_lowercase) {
        if allowed(c) {
            tag.push(c);
        } else if !tag.ends_with('-') {
            tag.push('-');
        }
    }
    tag.trim_matches('-').to_string()
}

/// The tags a worker has without asking: `gpu`, the GPU's model and its MIG profile for a GPU
/// worker; `cpu` otherwise.
pub fn automatic(gpu: Option<&GpuInfo>) -> Vec<String> {
    let Some(gpu) = gpu else {
        return vec!["cpu".to_string()];
    };
    let mut tags = vec!["gpu".to_string()];
    for name in [&gpu.name, &gpu.mig_profile] {
        let tag = as_tag(name);
        if !tag.is_empty() {
            tags.push(tag);
        }
    }
    tags
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_are_checked() {
        assert_eq!(check("gpu"), Ok(()));
        assert_eq!(check("a100:mig-1g.10gb_x"), Ok(()));
        assert_eq!(check(""), Err(TagError::Empty));
        assert_eq!(check("GPU"), Err(TagError::Invalid("GPU".into())));
        assert_eq!(check("a b"), Err(TagError::Invalid("a b".into())));
    }

    #[test]
    fn gpu_workers_get_their_model_and_mig_profile_as_tags() {
        assert_eq!(automatic(None), ["cpu"]);
        let gpu = GpuInfo {
            name: "NVIDIA H100 80GB HBM3".into(),
            mig_profile: "1g.10gb".into(),
            ..Default::default()
        };
        assert_eq!(
            automatic(Some(&gpu)),
            ["gpu", "nvidia-h100-80gb-hbm3", "1g.10gb"]
        );
        for tag in automatic(Some(&gpu)) {
            assert_eq!(check(&tag), Ok(()), "{tag}");
        }
    }
}
