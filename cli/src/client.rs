//! Client side of the scheduler API: submit a job, follow its progress with a bar per stage, and
//! fetch its results straight from the workers that hold them.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use wrk_host::table::Table;
use wrk_host::transfer::PeerClient;
use wrk_proto::auth::{AuthChannel, BearerToken};
use wrk_proto::scheduler_client::SchedulerClient;
use wrk_proto::{
    ClusterStatus, Empty, JobProgress, JobRef, JobSpec, JobState, MAX_MESSAGE_BYTES,
    SubmitJobRequest,
};

/// A scheduler client; `token` is the tenant's, for schedulers that require one.
pub async fn connect(url: &str, token: Option<&str>) -> Result<SchedulerClient<AuthChannel>> {
    let token = BearerToken::new(token).context("invalid --token")?;
    let channel = tonic::transport::Endpoint::from_shared(url.to_string())
        .with_context(|| format!("`{url}` is not a valid scheduler address"))?
        .connect_timeout(Duration::from_secs(10))
        .connect()
        .await
        .with_context(|| format!("cannot reach the scheduler at {url}"))?;
    Ok(SchedulerClient::with_interceptor(channel, token)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES))
}

pub async fn cluster_status(url: &str, token: Option<&str>) -> Result<ClusterStatus> {
    Ok(connect(url, token)
        .await?
        .get_cluster_status(Empty {})
        .await?
        .into_inner())
}

/// A finished job: its id, its result tables, and what it cost.
pub struct JobOutcome {
    pub job_id: String,
    pub tables: Vec<Table>,
    pub tasks: u64,
    pub elapsed: Duration,
}

/// Shows one bar per stage.
struct Bars {
    multi: MultiProgress,
    bars: Vec<ProgressBar>,
}

impl Bars {
    fn new(spec: &JobSpec, visible: bool) -> Self {
        let target = if visible {
            ProgressDrawTarget::stderr()
        } else {
            ProgressDrawTarget::hidden()
        };
        let multi = MultiProgress::with_draw_target(target);
        let style = ProgressStyle::with_template("{prefix:>16} [{bar:30}] {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> ");
        let bars = spec
            .stages
            .iter()
            .map(|stage| {
                let bar = multi.add(ProgressBar::new(u64::from(stage.num_tasks)));
                bar.set_style(style.clone());
                bar.set_prefix(stage.name.clone());
                bar
            })
            .collect();
        Bars { multi, bars }
    }

    fn update(&self, progress: &JobProgress) {
        for (bar, stage) in self.bars.iter().zip(&progress.stages) {
            bar.set_position(u64::from(stage.done));
            if stage.running > 0 {
                bar.set_message(format!("{} running", stage.running));
            } else if progress.waiting.contains(&format!("`{}`", stage.name)) {
                // Held back by something other than busy workers (tags no worker has).
                bar.set_message(progress.waiting.clone());
            } else {
                bar.set_message("");
            }
        }
    }

    fn finish(&self) {
        for bar in &self.bars {
            bar.finish();
        }
        let _ = self.multi.clear();
    }
}

/// Completes on SIGTERM (what Kubernetes sends a pod it stops, e.g. a Job past its deadline);
/// never where the signal cannot be watched.
async fn terminated(term: &mut Option<tokio::signal::unix::Signal>) {
    match term {
        Some(term) => {
            term.recv().await;
        }
        None => std::future::pending::<()>().await,
    }
}

/// Submits `spec`, follows it to the end and fetches its results; cancels it on Ctrl-C or
/// SIGTERM.
pub async fn run_job(
    url: &str,
    token: Option<&str>,
    spec: JobSpec,
    show_progress: bool,
) -> Result<JobOutcome> {
    run_job_with_report(url, token, spec, 0, show_progress, None).await
}

/// [`run_job`] at `priority` (among the tenant's jobs, higher first), writing the job's
/// performance report (see [`crate::report`]) to `report` once it has ended, succeeded or not.
pub async fn run_job_with_report(
    url: &str,
    token: Option<&str>,
    spec: JobSpec,
    priority: i32,
    show_progress: bool,
    report: Option<&Path>,
) -> Result<JobOutcome> {
    let mut client = connect(url, token).await?;
    // Watched from before the submission, so a SIGTERM from then on cancels the job.
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    let name = spec.name.clone();
    let persisted = !spec.persist.is_empty();
    let tasks: u64 = spec.stages.iter().map(|s| u64::from(s.num_tasks)).sum();
    let bars = Bars::new(&spec, show_progress);
    let started = Instant::now();
    let job_id = client
        .submit_job(SubmitJobRequest {
            job: Some(spec),
            keep_timeline: report.is_some(),
            priority,
        })
        .await
        .map_err(|s| anyhow::anyhow!("the scheduler refused job `{name}`: {}", s.message()))?
        .into_inner()
        .job_id;
    let job = JobRef {
        job_id: job_id.clone(),
    };
    let mut progress = client.watch_job(job.clone()).await?.into_inner();
    let last = loop {
        tokio::select! {
            message = progress.message() => match message? {
                Some(p) => {
                    bars.update(&p);
                    if matches!(p.state(), JobState::Succeeded | JobState::Failed | JobState::Cancelled) {
                        break p;
                    }
                }
                None => bail!("the scheduler stopped reporting on job `{name}` ({job_id})"),
            },
            _ = tokio::signal::ctrl_c() => {
                bars.finish();
                let _ = client.cancel_job(job.clone()).await;
                bail!("job `{name}` ({job_id}) cancelled by Ctrl-C");
            }
            _ = terminated(&mut term) => {
                bars.finish();
                let _ = client.cancel_job(job.clone()).await;
                bail!("job `{name}` ({job_id}) cancelled by SIGTERM");
            }
        }
    };
    bars.finish();
    let elapsed = started.elapsed();
    // The scheduler keeps the job's records until the job is released: fetch them first.
    let written = match report {
        Some(path) => {
            let timeline = client
                .get_job_timeline(job.clone())
                .await
                .map_err(|s| {
                    anyhow::anyhow!(
                        "cannot get the timeline of job `{name}` for its report: {}",
                        s.message()
                    )
                })?
                .into_inner();
            crate::report::write(path, &timeline)?;
            format!(" (performance report: {})", path.display())
        }
        None => String::new(),
    };
    match last.state() {
        JobState::Succeeded => {}
        JobState::Cancelled => bail!("job `{name}` ({job_id}) was cancelled{written}"),
        _ => bail!("job `{name}` ({job_id}) failed: {}{written}", last.error),
    }
    // Counted by the scheduler: a stage reading a dataset has as many tasks as it has partitions.
    let tasks = tasks.max(last.stages.iter().map(|s| u64::from(s.total)).sum::<u64>());
    if persisted {
        // The outputs stay on the workers as the dataset; the job is not released.
        return Ok(JobOutcome {
            job_id,
            tables: Vec::new(),
            tasks,
            elapsed,
        });
    }
    let result = client.get_job_result(job.clone()).await?.into_inner();
    let peers = PeerClient::new();
    let mut tables = Vec::with_capacity(result.partitions.len());
    for location in &result.partitions {
        let key = location.key.clone().unwrap_or_default();
        let table = peers
            .fetch(&location.address, &key, &location.ticket)
            .await
            .with_context(|| format!("fetching the results of job `{name}`"))?;
        // Results keep their value types: dictionary-encoded columns are written out.
        tables.push(wrk_host::cpu::dictionary::plain_batch(table.batch())?.into());
    }
    client.release_job(job).await?;
    Ok(JobOutcome {
        job_id,
        tables,
        tasks,
        elapsed,
    })
}
