//! What a `WrkJob` runs: the batch Job that submits the job file to the cluster's scheduler
//! (`wrk submit FILE --scheduler ADDRESS`), and the ephemeral `WrkCluster` created for a job that
//! names no cluster.

use std::collections::BTreeMap;

use k8s_openapi::api::batch::v1::{Job, JobSpec};
use k8s_openapi::api::core::v1::{
    ConfigMapVolumeSource, Container, PodSpec, PodTemplateSpec, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::{Resource, ResourceExt};

use super::{FIELD_MANAGER, LABEL_COMPONENT, LABEL_MANAGED_BY, LABEL_NAME, scheduler_address};
use crate::Error;
use crate::crd::{WrkCluster, WrkClusterSpec, WrkJob};

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

/// The batch Job submitting `job` to cluster `cluster` (whose image is the default).
pub fn submit_job(job: &WrkJob, cluster: &str, cluster_image: &str) -> Result<Job, Error> {
    let o = owner(job)?;
    let spec = &job.spec;
    let job_file = match &spec.source.config_map {
        Some(_) => format!("{JOB_DIR}/{}", spec.source.job_file),
        None => spec.source.job_file.clone(),
    };
    let mut args = vec![
        "submit".to_string(),
        job_file,
        "--scheduler".to_string(),
        scheduler_address(cluster, &o.namespace),
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
            active_deadline_seconds: spec.deadline_seconds,
            backoff_limit: Some(2),
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
                deadline_seconds: Some(600),
                ttl_seconds_after_finished: None,
            },
        );
        job.metadata.namespace = Some("data".to_string());
        job.metadata.uid = Some("6c1e8a1e-2f7a-4b55-9f0c-1b8f4a3c2d10".to_string());
        job
    }

    #[test]
    fn submit_job_runs_wrk_submit_against_the_cluster() {
        let j = submit_job(&job(Some("taxi-files")), "shared", "example.org/wrk:0.1.0").unwrap();
        assert_eq!(j.metadata.name.as_deref(), Some("taxi-submit"));
        let spec = j.spec.unwrap();
        assert_eq!(spec.active_deadline_seconds, Some(600));
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
        let rendered = submit_job(&j, "shared", "example.org/wrk:0.1.0").unwrap();
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
