//! Sources in an object store, end to end: the taxi job reads its trips from an S3 bucket served
//! by moto (a local server speaking the S3 API, installed by `tests/run.sh` into
//! `target/s3-venv`; no real bucket can be reached from here) through `wrk submit`, listing the
//! prefix, reading footers and only the projected column chunks by ranged requests, caching those
//! ranges locally, and matches the reference computed from the same files on disk.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::*;

/// A moto S3 server on a free port of 127.0.0.1, stopped when dropped.
struct S3Server {
    child: Child,
    address: String,
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn moto_server() -> Option<PathBuf> {
    let path = workspace_root().join("target/s3-venv/bin/moto_server");
    path.exists().then_some(path)
}

fn start_s3(moto: &Path) -> S3Server {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let child = Command::new(moto)
        .args(["-H", "127.0.0.1", "-p", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start moto_server");
    let address = format!("127.0.0.1:{port}");
    let server = S3Server { child, address };
    let deadline = Instant::now() + Duration::from_secs(60);
    while std::net::TcpStream::connect(&server.address).is_err() {
        assert!(Instant::now() < deadline, "moto_server did not start");
        std::thread::sleep(Duration::from_millis(100));
    }
    server
}

/// An unsigned HTTP PUT (moto accepts them), asserting success.
fn put(address: &str, path: &str, body: &[u8]) {
    let mut stream = std::net::TcpStream::connect(address).expect("connect to moto");
    write!(
        stream,
        "PUT {path} HTTP/1.1\r\nHost: {address}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .expect("send the request head");
    stream.write_all(body).expect("send the body");
    let mut response = String::new();
    stream
        .read_to_string(&mut response)
        .expect("read the response");
    assert!(
        response.starts_with("HTTP/1.1 200"),
        "PUT {path}: {response}"
    );
}

/// `wrk submit` of the taxi job over the bucket's `source`, object cache in `cache`.
fn submit(s3: &S3Server, source: &str, cache: &Path, result: &Path) -> std::process::Output {
    Command::new(wrk())
        .arg("submit")
        .arg(workspace_root().join("guest-examples/taxi-haversine/job.toml"))
        .args(["--workers", "2", "--quiet", "--output"])
        .arg(result)
        .arg("--source")
        .arg(format!("trips={source}"))
        .arg("--module")
        .arg(guest("taxi-haversine"))
        .env("AWS_ENDPOINT", format!("http://{}", s3.address))
        .env("AWS_ALLOW_HTTP", "true")
        .env("AWS_ACCESS_KEY_ID", "wrk-test")
        .env("AWS_SECRET_ACCESS_KEY", "wrk-test")
        .env("AWS_REGION", "us-east-1")
        .env("WRK_OBJECT_CACHE", cache)
        .output()
        .expect("run wrk submit")
}

#[test]
fn the_taxi_job_reads_its_trips_from_an_s3_bucket_by_ranges() {
    let Some(moto) = moto_server() else {
        println!("skipping: no moto_server in target/s3-venv (tests/run.sh installs it from PyPI)");
        return;
    };
    let _ = guest("taxi-haversine");
    let data = taxi_dataset(120_000, 3, 10_000);
    let s3 = start_s3(&moto);
    put(&s3.address, "/trips", b"");
    let mut files: Vec<PathBuf> = std::fs::read_dir(data.path())
        .expect("read the dataset")
        .map(|e| e.expect("dir entry").path())
        .collect();
    files.sort();
    let mut uploaded = 0u64;
    for file in &files {
        let name = file.file_name().expect("a file name").to_string_lossy();
        let body = std::fs::read(file).expect("read a data file");
        uploaded += body.len() as u64;
        put(&s3.address, &format!("/trips/taxi/{name}"), &body);
    }
    // Something else under the bucket that the prefix must not pick up.
    put(&s3.address, "/trips/other/readme.txt", b"not data");

    let work = tempfile::tempdir().expect("temp dir");
    let cache = work.path().join("objects");
    let result = work.path().join("summary.parquet");
    let run = submit(&s3, "s3://trips/taxi/", &cache, &result);
    assert!(
        run.status.success(),
        "wrk submit failed: {}",
        String::from_utf8_lossy(&run.stderr)
    );
    assert_summaries_match(&read_summary(&result), &taxi_reference(data.path()));

    // The job read each file's footer (its last 64 KiB) and the chunks of the five columns it
    // projects, as byte ranges: nothing else.
    let columns = [
        "pickup_longitude",
        "pickup_latitude",
        "dropoff_longitude",
        "dropoff_latitude",
        "passenger_count",
    ];
    let (mut chunks, mut footers) = (0u64, 0u64);
    for file in &files {
        let reader = parquet::file::serialized_reader::SerializedFileReader::new(
            std::fs::File::open(file).expect("open a data file"),
        )
        .expect("a Parquet file");
        let meta = parquet::file::reader::FileReader::metadata(&reader);
        for group in meta.row_groups() {
            for column in group.columns() {
                if columns.contains(&column.column_descr().name()) {
                    chunks += column.byte_range().1;
                }
            }
        }
        footers += std::fs::metadata(file)
            .expect("file size")
            .len()
            .min(64 * 1024);
    }
    let cached: u64 = std::fs::read_dir(&cache)
        .expect("the object cache exists")
        .map(|e| e.expect("cache entry").metadata().expect("metadata").len())
        .sum();
    assert!(
        cached >= chunks && cached <= chunks + footers && cached < uploaded,
        "{cached} bytes cached: the projected chunks are {chunks} bytes, the footers' reads \
         {footers}, the objects {uploaded}"
    );

    let missing = submit(&s3, "s3://trips/nothing/", &cache, &result);
    assert!(!missing.status.success());
    let stderr = String::from_utf8_lossy(&missing.stderr);
    assert!(
        stderr.contains("s3://trips/nothing/") && stderr.contains("no Parquet files"),
        "{stderr}"
    );
}
