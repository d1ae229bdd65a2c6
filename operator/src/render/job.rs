//! What a `WrkJob` runs: the batch Job that submits the job file to the cluster's scheduler
//! (`wrk submit FILE --scheduler ADDRESS`, with the tenant token from a Secret when the cluster
//! requires one), and the ephemeral `WrkCluster` created for a job that names no cluster.
//!
//! The submitting Job is not retried (`backoffLimit: 0`): a resubmission would rerun the whole job
//! from the start, and the scheduler already retries failed tasks. Its `activeDeadlineSeconds` is
//! what is left of the `WrkJob`'s deadline; when the Job controller stops the pod, `wrk submit`
//! cancels the job in the scheduler on SIGTERM.

use std::collections::BTreeMap;

use k8s_openapi::api::batch::v1::{Job, JobSpec};
use k8s_openapi::api::core::v1::{
    ConfigMapVolumeSource, Container, PodSpec, PodTemplateSpec, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::{Resource, ResourceExt};

use super::{
    FIELD_MANAGER, LABEL_COMPONENT, LABEL_MANAGED_BY, LABEL_NAME, env_from_secret,
    scheduler_address,
};
use crate::Error;
use crate::crd::{SecretKeyRef, WrkCluster, WrkClusterSpec, WrkJob};

pub const COMPONENT: &str = "job";
/// Label naming the `WrkJob` an object belongs to.
pub const LABEL_JOB: &str = "wrk.dev/job";
/// Where a job's ConfigMap is mounted.
pub const JOB_DIR: &str = "/job";

pub fn submit_job_name(job: &str) -> String {
    format!("{job}-submit")
}

struct JobOwner {
    name: String,
    namespace: String,
    reference: OwnerReference,
}

fn owner(job: &WrkJob) -> Result<JobOwner, Error> {
    Ok(JobOwner {
        name: job.name_any(),
        namespace: job
            .namespace()
            .ok_or(Error::MissingField("metadata.namespace"))?,
        reference: job
            .controller_owner_ref(&())
            .ok_or(Error::MissingField("metadata.uid"))?,
    })
}

fn labels(job: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (LABEL_NAME.to_string(), "wrk".to_string()),
        (LABEL_COMPONENT.to_string(), COMPONENT.to_string()),
        (LABEL_MANAGED_BY.to_string(), FIELD_MANAGER.to_string()),
        (LABEL_JOB.to_string(), job.to_string()),
    ])
}

/// The cluster created for a job that names none: same name as the job, owned by it.
pub fn ephemeral_cluster(job: &WrkJob, spec: &WrkClusterSpec) -> Result<WrkCluster, Error> {
    let o = owner(job)?;
    let mut cluster = WrkCluster::new(&o.name, spec.clone());
    cluster.metadata.namespace = Some(o.namespace);
    cluster.metadata.labels = Some(labels(&o.name));
    cluster.metadata.owner_references = Some(vec![o.reference]);
    Ok(cluster)
}

/// The tenant token `job` submits with: its own, else its cluster's client token.
pub fn token(job: &WrkJob, cluster: &WrkCluster) -> Option<SecretKeyRef> {
    job.spec
        .token
        .clone()
        .or_else(|| cluster.spec.auth.as_ref().map(|a| a.client_token()))
}

/// The batch Job submitting `job` to `cluster` (whose image is the default), to be stopped after
/// `active_deadline_seconds`.
pub fn submit_job(
    job: &WrkJob,
    cluster: &WrkCluster,
    active_deadline_seconds: Option<i64>,
) -> Result<Job, Error> {
    let o = owner(job)?;
    let spec = &job.spec;
    let cluster_name = cluster.name_any();
    let cluster_image = cluster.spec.image.as_str();
    let job_file = match &spec.source.config_map {
        Some(_) => format!("{JOB_DIR}/{}", spec.source.job_file),
        None => spec.source.job_file.clone(),
    };
    let mut args = vec![
        "submit".to_string(),
        job_file,
        "--scheduler".to_string(),
        scheduler_address(&cluster_name, &o.namespace),
        "--quiet".to_string(),
    ];
    for (key, value) in &spec.params {
        args.push("--param".to_string());
        args.push(format!("{key}={value}"));
    }
    let (volumes, mounts) = match &spec.source.config_map {
        Some(config_map) => (
            Some(vec![Volume {
                name: "job".to_string(),
                config_map: Some(ConfigMapVolumeSource {
                    name: config_map.clone(),
                    ..Default::default()
                }),
                ..Default::default()
            }]),
            Some(vec![VolumeMount {
                name: "job".to_string(),
                mount_path: JOB_DIR.to_string(),
                read_only: Some(true),
                ..Default::default()
            }]),
        ),
        None => (None, None),
    };
    let labels = labels(&o.name);
    Ok(Job {
        metadata: ObjectMeta {
            name: Some(submit_job_name(&o.name)),
            namespace: Some(o.namespace.clone()),
            labels: Some(labels.clone()),
            owner_references: Some(vec![o.reference]),
            ..Default::default()
        },
        spec: Some(JobSpec {
            active_deadline_seconds,
            backoff_limit: Some(0),
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(labels),
                    ..Default::default()
                }),
                spec: Some(PodSpec {
                    containers: vec![Container {
                        name: "submit".to_string(),
                        image: Some(
                            spec.image
                                .clone()
                                .unwrap_or_else(|| cluster_image.to_string()),
                        ),
                        args: Some(args),
                        env: token(job, cluster)
                            .map(|secret| vec![env_from_secret("WRK_TOKEN", &secret)]),
                        volume_mounts: mounts,
                        security_context: Some(super::scheduler::restricted_security_context()),
                        ..Default::default()
                    }],
                    volumes,
                    restart_policy: Some("Never".to_string()),
                    automount_service_account_token: Some(false),
                    ..Default::default()
                }),
            },
            ..Default::default()
        }),
        status: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::{JobSource, WrkJobSpec};
    use crate::render::testing;

    fn job(config_map: Option<&str>) -> WrkJob {
        let mut job = WrkJob::new(
            "taxi",
            WrkJobSpec {
                image: None,
                source: JobSource {
                    config_map: config_map.map(String::from),
                    job_file: "job.toml".to_string(),
                },
                cluster: Some("shared".to_string()),
                ephemeral_cluster: None,
                params: BTreeMap::from([("year".to_string(), "2024".to_string())]),
                token: None,
                deadline_seconds: Some(600),
                ttl_seconds_after_finished: None,
            },
        );
        job.metadata.namespace = Some("data".to_string());
        job.metadata.uid = Some("6c1e8a1e-2f7a-4b55-9f0c-1b8f4a3c2d10".to_string());
        job
    }

    fn shared() -> WrkCluster {
        let mut cluster = testing::cluster(vec![testing::group("g", 1, "nvidia.com/gpu")]);
        cluster.metadata.name = Some("shared".to_string());
        cluster
    }

    fn token_env(j: &Job) -> Option<(String, String)> {
        let pod = j.spec.as_ref()?.template.spec.as_ref()?;
        let env = pod.containers[0].env.as_ref()?;
        let token = env.iter().find(|e| e.name == "WRK_TOKEN")?;
        assert!(token.value.is_none(), "never the token itself");
        let key = token.value_from.as_ref()?.secret_key_ref.as_ref()?;
        Some((key.name.clone(), key.key.clone()))
    }

    #[test]
    fn submit_job_runs_wrk_submit_against_the_cluster() {
        let j = submit_job(&job(Some("taxi-files")), &shared(), Some(540)).unwrap();
        assert_eq!(j.metadata.name.as_deref(), Some("taxi-submit"));
        assert_eq!(token_env(&j), None, "an open cluster needs no token");
        let spec = j.spec.unwrap();
        assert_eq!(spec.active_deadline_seconds, Some(540));
        assert_eq!(spec.backoff_limit, Some(0));
        let pod = spec.template.spec.unwrap();
        let c = &pod.containers[0];
        assert_eq!(c.image.as_deref(), Some("example.org/wrk:0.1.0"));
        assert_eq!(
            c.args.as_ref().unwrap(),
            &[
                "submit",
                "/job/job.toml",
                "--scheduler",
                "http://shared-scheduler.data.svc:7070",
                "--quiet",
                "--param",
                "year=2024"
            ]
        );
        let volume = &pod.volumes.unwrap()[0];
        assert_eq!(volume.config_map.as_ref().unwrap().name, "taxi-files");
        assert_eq!(pod.restart_policy.as_deref(), Some("Never"));
    }

    #[test]
    fn image_source_uses_the_path_as_given() {
        let mut j = job(None);
        j.spec.source.job_file = "/opt/jobs/taxi.toml".to_string();
        j.spec.image = Some("example.org/taxi-job:1".to_string());
        let rendered = submit_job(&j, &shared(), None).unwrap();
        let pod = rendered.spec.unwrap().template.spec.unwrap();
        assert_eq!(
            pod.containers[0].args.as_ref().unwrap()[1],
            "/opt/jobs/taxi.toml"
        );
        assert_eq!(
            pod.containers[0].image.as_deref(),
            Some("example.org/taxi-job:1")
        );
        assert!(pod.volumes.is_none());
    }

    #[test]
    fn the_token_comes_from_the_job_or_else_the_cluster_auth() {
        let mut cluster = shared();
        cluster.spec.auth = Some(testing::auth("shared-tokens"));
        let mut j = job(None);
        let from_cluster = submit_job(&j, &cluster, None).unwrap();
        assert_eq!(
            token_env(&from_cluster),
            Some(("shared-tokens".to_string(), "client-token".to_string()))
        );
        j.spec.token = Some(SecretKeyRef {
            name: "alice".to_string(),
            key: "token".to_string(),
        });
        let own = submit_job(&j, &cluster, None).unwrap();
        assert_eq!(
            token_env(&own),
            Some(("alice".to_string(), "token".to_string()))
        );
    }

    #[test]
    fn ephemeral_cluster_is_owned_by_the_job() {
        let spec = testing::cluster(vec![testing::group("g", 1, "nvidia.com/gpu")]).spec;
        let c = ephemeral_cluster(&job(None), &spec).unwrap();
        assert_eq!(c.metadata.name.as_deref(), Some("taxi"));
        let owner = &c.metadata.owner_references.unwrap()[0];
        assert_eq!(owner.kind, "WrkJob");
        assert_eq!(owner.name, "taxi");
        assert_eq!(c.spec, spec);
    }
}
