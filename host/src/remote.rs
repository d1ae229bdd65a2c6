//! Sources and sinks in object stores (`s3://`, `gs://`, `az://`, `http(s)://`, and `file://`
//! through the same code), by way of the `object_store` crate.
//!
//! Credentials and endpoints come from the environment the way each store's own tools read them
//! (`AWS_ACCESS_KEY_ID`, `AWS_ENDPOINT`, `GOOGLE_SERVICE_ACCOUNT`, `AZURE_STORAGE_ACCOUNT_NAME`...).
//! A source object is downloaded once into a local cache (keyed by its URL, size and last
//! modification) and read from there like a local file, so row-group selection, projection and
//! predicate pushdown work unchanged. A sink object is written locally, then uploaded in one put.
//! `http(s)://` stores cannot be listed: name one object there, not a prefix.
//!
//! The I/O functions of `io` are synchronous (they run on blocking threads); each remote call
//! here runs on a small runtime of its own.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use futures::TryStreamExt;
use object_store::ObjectStore;
use object_store::path::Path as ObjectPath;
use sha2::{Digest, Sha256};

/// Why an object store call failed; the message names the URL.
#[derive(Debug, thiserror::Error)]
#[error("`{url}`: {detail}")]
pub struct RemoteError {
    pub url: String,
    pub detail: String,
}

/// Whether `uri` names an object store location rather than a local path.
pub fn is_remote(uri: &str) -> bool {
    [
        "s3://", "s3a://", "gs://", "az://", "abfs://", "abfss://", "http://", "https://",
    ]
    .iter()
    .any(|scheme| uri.starts_with(scheme))
}

fn error(url: &str, detail: impl std::fmt::Display) -> RemoteError {
    RemoteError {
        url: url.to_string(),
        detail: detail.to_string(),
    }
}

/// The store serving `url` and the object path inside it, configured from the environment.
fn store(url: &str) -> Result<(Arc<dyn ObjectStore>, ObjectPath), RemoteError> {
    let parsed = url::Url::parse(url).map_err(|e| error(url, e))?;
    let options: Vec<(String, String)> = std::env::vars()
        .filter(|(k, _)| {
            ["AWS_", "GOOGLE_", "AZURE_", "OBJECT_STORE_"]
                .iter()
                .any(|prefix| k.starts_with(prefix))
        })
        .map(|(k, v)| (k.to_ascii_lowercase(), v))
        .chain(
            // A plain-HTTP URL is an explicit choice of plain HTTP.
            url.starts_with("http://")
                .then(|| ("allow_http".to_string(), "true".to_string())),
        )
        .collect();
    let (store, path) =
        object_store::parse_url_opts(&parsed, options).map_err(|e| error(url, e))?;
    Ok((Arc::from(store), path))
}

/// Runs `future` to completion on a runtime of its own (on a scoped thread, so it works from a
/// runtime's blocking thread and from plain threads alike).
fn block_on<T: Send>(future: impl std::future::Future<Output = T> + Send) -> Result<T, String> {
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .map(|runtime| runtime.block_on(future))
                    .map_err(|e| format!("cannot start an I/O runtime: {e}"))
            })
            .join()
            .map_err(|_| "the I/O thread panicked".to_string())?
    })
}

/// The `.parquet` objects under `url` (the object itself when `url` names one), as URLs in
/// order.
pub fn list(url: &str) -> Result<Vec<String>, RemoteError> {
    let (store, path) = store(url)?;
    let base = url.trim_end_matches('/');
    let root = base
        .strip_suffix(path.as_ref())
        .unwrap_or(base)
        .trim_end_matches('/')
        .to_string();
    let found = block_on(async {
        if path.as_ref().ends_with(".parquet") && store.head(&path).await.is_ok() {
            return Ok(vec![path.clone()]);
        }
        let objects: Vec<_> = store.list(Some(&path)).try_collect().await?;
        Ok::<_, object_store::Error>(objects.into_iter().map(|o| o.location).collect())
    })
    .map_err(|e| error(url, e))?
    .map_err(|e| error(url, e))?;
    let mut urls: Vec<String> = found
        .iter()
        .filter(|p| p.as_ref().ends_with(".parquet"))
        .map(|p| format!("{root}/{p}"))
        .collect();
    urls.sort();
    Ok(urls)
}

/// A local file holding the object at `url`: downloaded into `cache` unless a copy of the same
/// size and modification time is already there.
pub fn fetch(url: &str, cache: &Path) -> Result<PathBuf, RemoteError> {
    let (store, path) = store(url)?;
    let result = block_on(async {
        let meta = store.head(&path).await?;
        let key = format!(
            "{url}\n{}\n{}",
            meta.size,
            meta.last_modified.timestamp_nanos_opt().unwrap_or_default()
        );
        let local = cache.join(format!("{}.parquet", hex::encode(Sha256::digest(key))));
        if std::fs::metadata(&local).is_ok_and(|m| m.len() == meta.size) {
            return Ok(Ok(local));
        }
        let bytes = store.get(&path).await?.bytes().await?;
        Ok::<_, object_store::Error>(write_atomically(&local, &bytes).map(|()| local))
    })
    .map_err(|e| error(url, e))?
    .map_err(|e| error(url, e))?;
    result.map_err(|e| error(url, format!("cannot cache the object locally: {e}")))
}

/// Uploads the local file `local` as the object `url`.
pub fn put(url: &str, local: &Path) -> Result<(), RemoteError> {
    let (store, path) = store(url)?;
    let bytes = std::fs::read(local).map_err(|e| error(url, e))?;
    block_on(async { store.put(&path, bytes.into()).await })
        .map_err(|e| error(url, e))?
        .map_err(|e| error(url, e))?;
    Ok(())
}

fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let partial = path.with_extension(format!("partial-{}", std::process::id()));
    std::fs::write(&partial, bytes)?;
    std::fs::rename(&partial, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remote_schemes_are_recognised() {
        assert!(is_remote("s3://bucket/trips/"));
        assert!(is_remote("https://example.org/trips.parquet"));
        assert!(!is_remote("/data/trips"));
        assert!(!is_remote("file:///data/trips"));
    }

    type Objects = Arc<std::sync::Mutex<std::collections::HashMap<String, Vec<u8>>>>;

    /// A minimal HTTP object server (GET, HEAD and PUT on any path, objects in memory), the
    /// closest honest stand-in for a bucket on a machine without network access.
    fn object_server(runtime: &tokio::runtime::Runtime) -> (String, Objects) {
        use axum::http::{HeaderMap, StatusCode, Uri, header};
        let objects: Objects = Arc::default();
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let address = listener.local_addr().unwrap();
        let (for_get, for_put) = (objects.clone(), objects.clone());
        let router = axum::Router::new().fallback(
            axum::routing::get(move |uri: Uri| {
                let objects = for_get.clone();
                async move {
                    let found = objects.lock().unwrap().get(uri.path()).cloned();
                    match found {
                        Some(bytes) => {
                            let mut headers = HeaderMap::new();
                            headers.insert(
                                header::LAST_MODIFIED,
                                "Sat, 21 Nov 2026 10:00:00 GMT".parse().unwrap(),
                            );
                            headers.insert(
                                header::ETAG,
                                format!("\"{}\"", bytes.len()).parse().unwrap(),
                            );
                            (StatusCode::OK, headers, bytes)
                        }
                        None => (StatusCode::NOT_FOUND, HeaderMap::new(), Vec::new()),
                    }
                }
            })
            .put(move |uri: Uri, body: axum::body::Bytes| {
                let objects = for_put.clone();
                async move {
                    objects
                        .lock()
                        .unwrap()
                        .insert(uri.path().to_string(), body.to_vec());
                    StatusCode::CREATED
                }
            }),
        );
        runtime.spawn(async move { axum::serve(listener, router).await });
        (format!("http://{address}"), objects)
    }

    #[test]
    fn sources_and_sinks_over_http() {
        use arrow::array::{AsArray, Int64Array, RecordBatch};
        use arrow::datatypes::Int64Type;
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let (base, objects) = object_server(&runtime);
        let cache = tempfile::tempdir().unwrap();
        let batch = RecordBatch::try_from_iter(vec![(
            "id",
            Arc::new(Int64Array::from_iter_values(0..1000)) as arrow::array::ArrayRef,
        )])
        .unwrap();
        let sink = format!("{base}/out");
        let written = crate::io::write_table(&sink, "part-0", &batch).unwrap();
        assert_eq!(written, format!("{base}/out/part-0.parquet"));
        assert!(objects.lock().unwrap().contains_key("/out/part-0.parquet"));

        let local = fetch(&written, cache.path()).unwrap();
        assert!(local.starts_with(cache.path()));
        let again = fetch(&written, cache.path()).unwrap();
        assert_eq!(local, again, "the cached copy is reused");
        assert_eq!(list(&written).unwrap(), vec![written.clone()]);

        let partitions = crate::io::plan_partitions(&written, &[], 1).unwrap();
        assert_eq!(
            partitions[0].files[0].uri, written,
            "plans name the object, not the cache"
        );
        let read = crate::io::read_partition(&partitions[0]).unwrap();
        let ids = read.column(0).as_primitive::<Int64Type>();
        assert_eq!((ids.len(), ids.value(999)), (1000, 999));

        let err = fetch(&format!("{base}/missing.parquet"), cache.path())
            .unwrap_err()
            .to_string();
        assert!(err.contains("missing.parquet"), "{err}");
    }

    #[test]
    fn a_malformed_url_is_named() {
        let err = list("s3://").unwrap_err().to_string();
        assert!(err.contains("`s3://`"), "{err}");
    }
}
