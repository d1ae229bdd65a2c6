//! The data lifecycle commands: `wrk datasets`, `wrk release-dataset`, `wrk rebalance` and
//! `wrk retire`, over the scheduler's dataset and retirement calls.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use wrk_proto::{DatasetRef, Empty, JobState, PersistedDataset, WorkerRef};

use crate::client::connect;

/// How often the waiting commands look again.
const POLL: Duration = Duration::from_millis(200);

fn state_name(dataset: &PersistedDataset) -> &'static str {
    match JobState::try_from(dataset.state).unwrap_or(JobState::Unspecified) {
        JobState::Succeeded => "ready",
        JobState::Pending | JobState::Running => "computing",
        JobState::Failed => "failed",
        JobState::Cancelled => "cancelled",
        JobState::Unspecified => "unknown",
    }
}

/// One line per dataset: name, state, partitions, rows, bytes and where the partitions are.
pub fn format_datasets(datasets: &[PersistedDataset]) -> String {
    if datasets.is_empty() {
        return "no datasets\n".into();
    }
    let mut text = format!(
        "{:<20} {:<10} {:>10} {:>12} {:>14}  {}\n",
        "NAME", "STATE", "PARTITIONS", "ROWS", "BYTES", "WORKERS (partitions/bytes)"
    );
    for d in datasets {
        let workers: Vec<String> = d
            .workers
            .iter()
            .map(|w| format!("{}:{}/{}", w.worker_id, w.partitions, w.bytes))
            .collect();
        let mut line = format!(
            "{:<20} {:<10} {:>10} {:>12} {:>14}  {}",
            d.name,
            state_name(d),
            d.partitions,
            d.rows,
            d.bytes,
            workers.join(" ")
        );
        if d.moving > 0 {
            line.push_str(&format!(" ({} moving)", d.moving));
        }
        if !d.error.is_empty() {
            line.push_str(&format!(" error: {}", d.error));
        }
        text.push_str(&line);
        text.push('\n');
    }
    text
}

/// The datasets of the tenant `token` names.
pub async fn list(url: &str, token: Option<&str>) -> Result<Vec<PersistedDataset>> {
    Ok(connect(url, token)
        .await?
        .persisted_datasets(Empty {})
        .await
        .map_err(|s| anyhow::anyhow!("cannot list datasets: {}", s.message()))?
        .into_inner()
        .datasets)
}

/// The tenant's dataset `name`.
pub async fn find(url: &str, token: Option<&str>, name: &str) -> Result<PersistedDataset> {
    list(url, token)
        .await?
        .into_iter()
        .find(|d| d.name == name)
        .with_context(|| format!("no dataset `{name}`"))
}

pub async fn release(url: &str, token: Option<&str>, name: &str) -> Result<()> {
    connect(url, token)
        .await?
        .release_dataset(DatasetRef {
            name: name.to_string(),
        })
        .await
        .map_err(|s| anyhow::anyhow!("cannot release dataset `{name}`: {}", s.message()))?;
    Ok(())
}

/// Rebalances dataset `name` and waits up to `timeout` for its moves to complete; returns how
/// many partitions moved.
pub async fn rebalance(
    url: &str,
    token: Option<&str>,
    name: &str,
    timeout: Duration,
) -> Result<u32> {
    let moves = connect(url, token)
        .await?
        .rebalance_dataset(DatasetRef {
            name: name.to_string(),
        })
        .await
        .map_err(|s| anyhow::anyhow!("cannot rebalance dataset `{name}`: {}", s.message()))?
        .into_inner()
        .moves;
    let started = Instant::now();
    loop {
        let dataset = find(url, token, name).await?;
        if dataset.moving == 0 {
            return Ok(moves);
        }
        if started.elapsed() > timeout {
            bail!(
                "dataset `{name}`: {} of {moves} partition moves still under way after {timeout:?}",
                dataset.moving
            );
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Retires worker `worker_id` and waits up to `timeout` for it to leave the cluster.
pub async fn retire(
    url: &str,
    token: Option<&str>,
    worker_id: &str,
    timeout: Duration,
) -> Result<wrk_proto::RetireResponse> {
    let mut client = connect(url, token).await?;
    let response = client
        .retire_worker(WorkerRef {
            worker_id: worker_id.to_string(),
        })
        .await
        .map_err(|s| anyhow::anyhow!("cannot retire worker `{worker_id}`: {}", s.message()))?
        .into_inner();
    let started = Instant::now();
    loop {
        let status = client.get_cluster_status(Empty {}).await?.into_inner();
        if !status.workers.iter().any(|w| w.worker_id == worker_id) {
            return Ok(response);
        }
        if started.elapsed() > timeout {
            bail!("worker `{worker_id}` is still retiring after {timeout:?}");
        }
        tokio::time::sleep(POLL).await;
    }
}
