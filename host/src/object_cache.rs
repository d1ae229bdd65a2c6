//! A bounded cache on local disk of byte ranges read from object stores.
//!
//! Each entry is one range of one version of an object (its URL, size and modification time or
//! entity tag), in a file named by a hash of that key. A hit refreshes the file's modification
//! time; after every insertion the cache evicts the least recently used entries until it holds at
//! most its capacity. Several worker processes of a host may share the directory: entries are
//! written to a private name and renamed into place, a missing or short entry is a miss, and
//! eviction deletes whatever is oldest in the directory, whoever wrote it.

use std::io::Read;
use std::ops::Range;
use std::path::PathBuf;
use std::time::SystemTime;

use bytes::Bytes;
use sha2::{Digest, Sha256};

/// The default capacity when `WRK_OBJECT_CACHE_BYTES` is not set.
pub const DEFAULT_CAPACITY: u64 = 8 << 30;

/// Suffix of complete entries; anything else in the directory (partial writes) is not counted.
const ENTRY_SUFFIX: &str = ".range";

/// A cache directory and the most bytes it may hold.
#[derive(Debug, Clone)]
pub struct ObjectCache {
    dir: PathBuf,
    capacity: u64,
}

/// One version of one object: ranges of different versions never match.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ObjectVersion {
    pub url: String,
    pub size: u64,
    /// The entity tag, else the modification time: whatever changes when the object does.
    pub tag: String,
}

impl ObjectCache {
    /// A cache in `dir` holding at most `capacity` bytes (0 caches nothing).
    pub fn new(dir: PathBuf, capacity: u64) -> Self {
        Self { dir, capacity }
    }

    /// The cached bytes of `range` of `object`, if present and complete.
    pub fn get(&self, object: &ObjectVersion, range: &Range<u64>) -> Option<Bytes> {
        if self.capacity == 0 {
            return None;
        }
        let path = self.entry(object, range);
        // Opened for appending too, so the same handle refreshes the entry's age.
        let mut file = std::fs::File::options()
            .read(true)
            .append(true)
            .open(&path)
            .ok()?;
        let mut bytes = Vec::with_capacity((range.end - range.start) as usize);
        file.read_to_end(&mut bytes).ok()?;
        if bytes.len() as u64 != range.end - range.start {
            // Truncated by a crash or a full disk: drop it and read the object again.
            let _ = std::fs::remove_file(&path);
            return None;
        }
        // Refresh the entry's age for eviction; failing to is harmless.
        let _ = file.set_modified(SystemTime::now());
        Some(Bytes::from(bytes))
    }

    /// Stores `bytes` as `range` of `object`, then evicts the least recently used entries beyond
    /// the capacity. Ranges larger than the whole cache are not stored.
    pub fn insert(
        &self,
        object: &ObjectVersion,
        range: &Range<u64>,
        bytes: &[u8],
    ) -> std::io::Result<()> {
        if bytes.len() as u64 > self.capacity {
            return Ok(());
        }
        std::fs::create_dir_all(&self.dir)?;
        let path = self.entry(object, range);
        let partial = path.with_extension(format!("partial-{}", std::process::id()));
        std::fs::write(&partial, bytes)?;
        std::fs::rename(&partial, &path)?;
        self.evict()
    }

    /// Deletes the oldest entries until the directory holds at most the capacity.
    fn evict(&self) -> std::io::Result<()> {
        let mut entries = Vec::new();
        let mut total = 0u64;
        for entry in std::fs::read_dir(&self.dir)? {
            let entry = entry?;
            if !entry.file_name().to_string_lossy().ends_with(ENTRY_SUFFIX) {
                continue;
            }
            // Another process may have evicted it since the listing.
            let Ok(meta) = entry.metadata() else { continue };
            total += meta.len();
            let used = meta.modified().unwrap_or(SystemTime::UNIX_EPOCH);
            entries.push((used, meta.len(), entry.path()));
        }
        if total <= self.capacity {
            return Ok(());
        }
        entries.sort();
        for (_, len, path) in entries {
            if total <= self.capacity {
                break;
            }
            match std::fs::remove_file(&path) {
                Ok(()) => {
                    tracing::debug!(entry = %path.display(), bytes = len, "evicted from the object cache");
                    total -= len;
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => total -= len,
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    fn entry(&self, object: &ObjectVersion, range: &Range<u64>) -> PathBuf {
        let key = format!(
            "{}\n{}\n{}\n{}-{}",
            object.url, object.size, object.tag, range.start, range.end
        );
        self.dir.join(format!(
            "{}{ENTRY_SUFFIX}",
            hex::encode(Sha256::digest(key))
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn object(tag: &str) -> ObjectVersion {
        ObjectVersion {
            url: "s3://bucket/trips.parquet".into(),
            size: 1 << 20,
            tag: tag.into(),
        }
    }

    fn entries(cache: &ObjectCache) -> usize {
        std::fs::read_dir(&cache.dir).map_or(0, |d| d.count())
    }

    #[test]
    fn a_range_reads_back_only_for_the_same_version_and_range() {
        let dir = tempfile::tempdir().unwrap();
        let cache = ObjectCache::new(dir.path().join("objects"), 1 << 20);
        let v1 = object("\"v1\"");
        assert_eq!(cache.get(&v1, &(0..4)), None);
        cache.insert(&v1, &(0..4), b"PAR1").unwrap();
        assert_eq!(cache.get(&v1, &(0..4)).as_deref(), Some(&b"PAR1"[..]));
        assert_eq!(cache.get(&v1, &(0..3)), None, "another range");
        assert_eq!(
            cache.get(&object("\"v2\""), &(0..4)),
            None,
            "another version"
        );
    }

    #[test]
    fn the_least_recently_used_entries_are_evicted_beyond_the_capacity() {
        let dir = tempfile::tempdir().unwrap();
        let cache = ObjectCache::new(dir.path().to_path_buf(), 250);
        let v = object("t");
        let old = SystemTime::now() - std::time::Duration::from_secs(60);
        for (i, range) in [0..100u64, 100..200].iter().enumerate() {
            cache.insert(&v, range, &[i as u8; 100]).unwrap();
            // Distinct ages without sleeping: the first entry is the oldest...
            let age = old + std::time::Duration::from_secs(i as u64);
            std::fs::File::options()
                .append(true)
                .open(cache.entry(&v, range))
                .unwrap()
                .set_modified(age)
                .unwrap();
        }
        // ...until a hit makes it the most recent.
        assert!(cache.get(&v, &(0..100)).is_some());
        cache.insert(&v, &(200..300), &[2; 100]).unwrap();
        assert_eq!(entries(&cache), 2);
        assert!(cache.get(&v, &(100..200)).is_none(), "the oldest is gone");
        assert_eq!(cache.get(&v, &(0..100)).unwrap()[0], 0);
        assert_eq!(cache.get(&v, &(200..300)).unwrap()[0], 2);
    }

    #[test]
    fn a_truncated_entry_is_a_miss_and_is_removed() {
        let dir = tempfile::tempdir().unwrap();
        let cache = ObjectCache::new(dir.path().to_path_buf(), 1 << 20);
        let v = object("t");
        cache.insert(&v, &(0..8), b"12345678").unwrap();
        std::fs::write(cache.entry(&v, &(0..8)), b"1234").unwrap();
        assert_eq!(cache.get(&v, &(0..8)), None);
        assert_eq!(entries(&cache), 0);
    }

    #[test]
    fn a_zero_capacity_caches_nothing_and_oversized_ranges_are_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let off = ObjectCache::new(dir.path().join("off"), 0);
        off.insert(&object("t"), &(0..4), b"PAR1").unwrap();
        assert_eq!(off.get(&object("t"), &(0..4)), None);
        let small = ObjectCache::new(dir.path().join("small"), 3);
        small.insert(&object("t"), &(0..4), b"PAR1").unwrap();
        assert_eq!(entries(&small), 0);
    }
}
