//! Sources and sinks in object stores (`s3://`, `gs://`, `az://`, `http(s)://`, and `file://`
//! through the same code), by way of the `object_store` crate.
//!
//! Credentials and endpoints come from the environment the way each store's own tools read them
//! (`AWS_ACCESS_KEY_ID`, `AWS_ENDPOINT`, `GOOGLE_SERVICE_ACCOUNT`, `AZURE_STORAGE_ACCOUNT_NAME`...).
//! A source object is read by byte ranges: its footer, then only the column chunks of the row
//! groups a read selects, each range kept in a bounded local cache (`object_cache`) keyed by the
//! object's version. A sink object is written locally, then uploaded in one put.
//! `http(s)://` stores cannot be listed: name one object there, not a prefix.
//!
//! The I/O functions of `io` are synchronous (they run on blocking threads); each remote call
//! here runs on a small runtime of its own.

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;

use futures::TryStreamExt;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectMeta, ObjectStore};

use crate::object_cache::{ObjectCache, ObjectVersion};

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

/// The `.parquet` objects under `url` (the object itself when `url` names one), in URL order,
/// opened for ranged reads through `cache`: the listing gives each one's size and version, so
/// none needs a `HEAD` of its own.
pub fn list(url: &str, cache: &ObjectCache) -> Result<Vec<RemoteObject>, RemoteError> {
    let (store, path) = store(url)?;
    let base = url.trim_end_matches('/');
    let root = base
        .strip_suffix(path.as_ref())
        .unwrap_or(base)
        .trim_end_matches('/')
        .to_string();
    let found = block_on(async {
        if path.as_ref().ends_with(".parquet")
            && let Ok(meta) = store.head(&path).await
        {
            return Ok(vec![meta]);
        }
        store.list(Some(&path)).try_collect::<Vec<_>>().await
    })
    .map_err(|e| error(url, e))?
    .map_err(|e| error(url, e))?;
    let mut objects: Vec<RemoteObject> = found
        .into_iter()
        .filter(|meta| meta.location.as_ref().ends_with(".parquet"))
        .map(|meta| {
            let url = format!("{root}/{}", meta.location);
            RemoteObject::new(url, store.clone(), meta, cache.clone())
        })
        .collect();
    objects.sort_by(|a, b| a.url().cmp(b.url()));
    Ok(objects)
}

/// One version of an object, read by byte ranges through the local cache.
pub struct RemoteObject {
    store: Arc<dyn ObjectStore>,
    path: ObjectPath,
    version: ObjectVersion,
    cache: ObjectCache,
}

impl RemoteObject {
    /// Looks the object up (one `HEAD`): its size and version key every range read later.
    pub fn open(url: &str, cache: ObjectCache) -> Result<Self, RemoteError> {
        let (store, path) = store(url)?;
        let meta = block_on(store.head(&path))
            .map_err(|e| error(url, e))?
            .map_err(|e| error(url, e))?;
        Ok(Self::new(url.to_string(), store, meta, cache))
    }

    /// The object `meta` describes (from a `HEAD` or a listing), named `url`.
    fn new(url: String, store: Arc<dyn ObjectStore>, meta: ObjectMeta, cache: ObjectCache) -> Self {
        let tag = meta.e_tag.or(meta.version).unwrap_or_else(|| {
            meta.last_modified
                .timestamp_nanos_opt()
                .unwrap_or_default()
                .to_string()
        });
        Self {
            store,
            path: meta.location,
            version: ObjectVersion {
                url,
                size: meta.size,
                tag,
            },
            cache,
        }
    }

    pub fn url(&self) -> &str {
        &self.version.url
    }

    pub fn size(&self) -> u64 {
        self.version.size
    }

    /// The bytes of each range, from the cache where it has them and otherwise from the store
    /// (adjacent ranges coalesced into one request, several requests in flight).
    pub fn read_ranges(&self, ranges: &[Range<u64>]) -> Result<Vec<Bytes>, RemoteError> {
        let url = self.url();
        if let Some(bad) = ranges
            .iter()
            .find(|r| r.start > r.end || r.end > self.size())
        {
            return Err(error(
                url,
                format!(
                    "bytes {}..{} are outside the object's {} bytes",
                    bad.start,
                    bad.end,
                    self.size()
                ),
            ));
        }
        let mut found: Vec<Option<Bytes>> = ranges
            .iter()
            .map(|range| self.cache.get(&self.version, range))
            .collect();
        let missing: Vec<Range<u64>> = ranges
            .iter()
            .zip(&found)
            .filter(|(_, hit)| hit.is_none())
            .map(|(range, _)| range.clone())
            .collect();
        if !missing.is_empty() {
            let fetched = block_on(self.store.get_ranges(&self.path, &missing))
                .map_err(|e| error(url, e))?
                .map_err(|e| error(url, e))?;
            let mut fetched = missing.iter().zip(fetched);
            for slot in found.iter_mut().filter(|slot| slot.is_none()) {
                let Some((range, bytes)) = fetched.next() else {
                    break;
                };
                if bytes.len() as u64 != range.end - range.start {
                    return Err(error(
                        url,
                        format!(
                            "asked for bytes {}..{}, got {} bytes",
                            range.start,
                            range.end,
                            bytes.len()
                        ),
                    ));
                }
                if let Err(e) = self.cache.insert(&self.version, range, &bytes) {
                    tracing::warn!(object = url, error = %e, "cannot cache a range locally");
                }
                *slot = Some(bytes);
            }
        }
        found
            .into_iter()
            .map(|bytes| {
                bytes.ok_or_else(|| error(url, "the store returned fewer ranges than asked"))
            })
            .collect()
    }
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

/// An HTTP object server for tests, the closest honest stand-in for a bucket on a machine
/// without network access.
#[cfg(test)]
pub(crate) mod test_server {
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Arc, Mutex};

    use axum::http::{HeaderMap, Method, StatusCode, Uri, header};

    /// The objects served (by path) and what was asked of the server.
    #[derive(Default)]
    pub struct Objects {
        pub bodies: Mutex<HashMap<String, Vec<u8>>>,
        pub gets: AtomicU64,
        pub bytes_sent: AtomicU64,
    }

    impl Objects {
        pub fn gets(&self) -> u64 {
            self.gets.load(Ordering::SeqCst)
        }
        pub fn bytes_sent(&self) -> u64 {
            self.bytes_sent.load(Ordering::SeqCst)
        }
    }

    /// `bytes=START-END` (inclusive) of an object of `len` bytes.
    fn range(headers: &HeaderMap, len: usize) -> Option<(usize, usize)> {
        let spec = headers.get(header::RANGE)?.to_str().ok()?;
        let (start, end) = spec.strip_prefix("bytes=")?.split_once('-')?;
        let start: usize = start.parse().ok()?;
        let end: usize = end.parse::<usize>().map_or(len - 1, |e| e.min(len - 1));
        (start <= end).then_some((start, end))
    }

    /// Serves GET (with single ranges), HEAD and PUT on any path; objects held in memory, their
    /// entity tag their length.
    pub fn start(runtime: &tokio::runtime::Runtime) -> (String, Arc<Objects>) {
        let objects: Arc<Objects> = Arc::default();
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let address = listener.local_addr().unwrap();
        let (for_get, for_put) = (objects.clone(), objects.clone());
        let router = axum::Router::new().fallback(
            axum::routing::get(move |method: Method, uri: Uri, request: HeaderMap| {
                let objects = for_get.clone();
                async move {
                    let found = objects.bodies.lock().unwrap().get(uri.path()).cloned();
                    let Some(body) = found else {
                        return (StatusCode::NOT_FOUND, HeaderMap::new(), Vec::new());
                    };
                    let mut headers = HeaderMap::new();
                    headers.insert(
                        header::LAST_MODIFIED,
                        "Sat, 21 Nov 2026 10:00:00 GMT".parse().unwrap(),
                    );
                    headers.insert(header::ETAG, format!("\"{}\"", body.len()).parse().unwrap());
                    headers.insert(header::ACCEPT_RANGES, "bytes".parse().unwrap());
                    if method == Method::HEAD {
                        return (StatusCode::OK, headers, body);
                    }
                    objects.gets.fetch_add(1, Ordering::SeqCst);
                    let (status, sent) = match range(&request, body.len()) {
                        Some((start, end)) => {
                            headers.insert(
                                header::CONTENT_RANGE,
                                format!("bytes {start}-{end}/{}", body.len())
                                    .parse()
                                    .unwrap(),
                            );
                            (StatusCode::PARTIAL_CONTENT, body[start..=end].to_vec())
                        }
                        None => (StatusCode::OK, body),
                    };
                    objects
                        .bytes_sent
                        .fetch_add(sent.len() as u64, Ordering::SeqCst);
                    (status, headers, sent)
                }
            })
            .put(move |uri: Uri, body: axum::body::Bytes| {
                let objects = for_put.clone();
                async move {
                    objects
                        .bodies
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

    #[test]
    fn sinks_are_uploaded_and_sources_planned_and_read_over_http() {
        use arrow::array::{AsArray, Int64Array, RecordBatch};
        use arrow::datatypes::Int64Type;
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let (base, objects) = test_server::start(&runtime);
        let batch = RecordBatch::try_from_iter(vec![(
            "id",
            Arc::new(Int64Array::from_iter_values(0..1000)) as arrow::array::ArrayRef,
        )])
        .unwrap();
        let sink = format!("{base}/out");
        let written = crate::io::write_table(&sink, "part-0", &batch).unwrap();
        assert_eq!(written, format!("{base}/out/part-0.parquet"));
        assert!(
            objects
                .bodies
                .lock()
                .unwrap()
                .contains_key("/out/part-0.parquet")
        );
        let cache = tempfile::tempdir().unwrap();
        let cache = ObjectCache::new(cache.path().to_path_buf(), 1 << 20);
        let listed: Vec<String> = list(&written, &cache)
            .unwrap()
            .iter()
            .map(|object| object.url().to_string())
            .collect();
        assert_eq!(listed, vec![written.clone()]);

        let partitions = crate::io::plan_partitions(&written, &[], 1).unwrap();
        assert_eq!(
            partitions[0].files[0].uri, written,
            "plans name the object, not a local copy"
        );
        let read = crate::io::read_partition(&partitions[0]).unwrap();
        let ids = read.column(0).as_primitive::<Int64Type>();
        assert_eq!((ids.len(), ids.value(999)), (1000, 999));
    }

    #[test]
    fn ranges_are_checked_and_missing_objects_named() {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let (base, objects) = test_server::start(&runtime);
        objects
            .bodies
            .lock()
            .unwrap()
            .insert("/ten".into(), b"0123456789".to_vec());
        let cache = tempfile::tempdir().unwrap();
        let cache = ObjectCache::new(cache.path().to_path_buf(), 1 << 20);
        let object = RemoteObject::open(&format!("{base}/ten"), cache.clone()).unwrap();
        assert_eq!(object.size(), 10);
        let read = object.read_ranges(&[2..4, 8..10]).unwrap();
        assert_eq!((&read[0][..], &read[1][..]), (&b"23"[..], &b"89"[..]));
        let beyond = 8..11;
        let err = object
            .read_ranges(std::slice::from_ref(&beyond))
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("/ten") && err.contains("outside the object's 10 bytes"),
            "{err}"
        );
        let err = RemoteObject::open(&format!("{base}/missing.parquet"), cache)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("missing.parquet"), "{err}");
    }

    #[test]
    fn a_malformed_url_is_named() {
        let cache = ObjectCache::new(std::env::temp_dir(), 0);
        let err = list("s3://", &cache).err().unwrap().to_string();
        assert!(err.contains("`s3://`"), "{err}");
    }
}
