//! Spill files: partitions moved out of the pool as Arrow IPC streams in the worker's own spill
//! directory, removed when their partition is released, and cleaned at start when a crashed
//! worker left them behind.
//!
//! Every worker spills into `<spill root>/wrk-spill-<worker id>/`, a directory holding a marker
//! file ([`MARKER`]) naming the host and process that own it (its number and start time, since
//! a restarted container's first process has the same number as the last one's). At start a
//! worker empties the directories of dead workers of its host, then takes its own, or, when a
//! live worker of the same id holds that, one suffixed with its process number; it removes its
//! directory when it stops. It only ever
//! deletes files named like the ones it writes (`part-*.arrows`) in directories carrying the
//! marker, so a mistyped `--spill-dir` never costs anyone their files.

use std::fs::File;
use std::io::{BufReader, BufWriter, Read};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use arrow::array::{Array, ArrayRef};
use arrow::ipc::reader::StreamReader;
use arrow::ipc::writer::StreamWriter;
use arrow::record_batch::RecordBatch;

/// The marker file of a spill directory.
pub const MARKER: &str = "WRK_SPILL_DIR";
const DIR_PREFIX: &str = "wrk-spill-";
const FILE_PREFIX: &str = "part-";
const FILE_SUFFIX: &str = ".arrows";

#[derive(Debug, thiserror::Error)]
pub enum SpillError {
    #[error("cannot prepare the spill directory {path}: {source}")]
    Prepare {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot write spill file {path}: {detail}")]
    Write { path: PathBuf, detail: String },
    #[error("cannot read spill file {path}: {detail}")]
    Read { path: PathBuf, detail: String },
}

/// The default spill root: `wrk-spill` under the system's temporary directory.
pub fn default_root() -> PathBuf {
    std::env::temp_dir().join("wrk-spill")
}

/// This worker's spill directory.
#[derive(Debug)]
pub struct SpillDir {
    dir: PathBuf,
    next: AtomicU64,
}

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_default()
}

/// The directory name of a worker: its id with anything but `[A-Za-z0-9._-]` replaced.
fn dir_name(worker_id: &str) -> String {
    let safe: String = worker_id
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("{DIR_PREFIX}{safe}")
}

/// When process `pid` started, in clock ticks since boot (`/proc/<pid>/stat`, field 22).
fn process_start(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold spaces: count after it.
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// The marker of a directory this process owns.
fn marker(host: &str, worker_id: &str) -> String {
    let pid = std::process::id();
    let start = process_start(pid).unwrap_or(0);
    format!("{host} {pid} {start} {worker_id}\n")
}

/// Whether a spill directory's marker names a process of this host that no longer runs.
fn owner_is_gone(marker: &str, host: &str) -> bool {
    let mut fields = marker.split_whitespace();
    let (Some(owner_host), Some(pid), Some(start)) = (fields.next(), fields.next(), fields.next())
    else {
        return false;
    };
    let (Ok(pid), Ok(start)) = (pid.parse::<u32>(), start.parse::<u64>()) else {
        return false;
    };
    owner_host == host && process_start(pid) != Some(start)
}

/// Deletes the spill files (and the marker) of one spill directory, then the directory if it
/// is empty. Returns the number of spill files removed.
fn clean(dir: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut removed = 0;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with(FILE_PREFIX)
            && name.ends_with(FILE_SUFFIX)
            && std::fs::remove_file(entry.path()).is_ok()
        {
            removed += 1;
        }
    }
    let _ = std::fs::remove_file(dir.join(MARKER));
    let _ = std::fs::remove_dir(dir);
    removed
}

impl SpillDir {
    /// Prepares `<root>/wrk-spill-<worker id>/`, removing what a previous run of this worker, or
    /// a dead worker of this host, left under `root`.
    pub fn open(root: &Path, worker_id: &str) -> Result<Self, SpillError> {
        let prepare = |path: &Path, source| SpillError::Prepare {
            path: path.to_path_buf(),
            source,
        };
        std::fs::create_dir_all(root).map_err(|e| prepare(root, e))?;
        let host = host_name();
        let mut removed = 0;
        for entry in std::fs::read_dir(root)
            .map_err(|e| prepare(root, e))?
            .flatten()
        {
            let path = entry.path();
            let is_spill_dir =
                entry.file_name().to_string_lossy().starts_with(DIR_PREFIX) && path.is_dir();
            let Ok(marker) = std::fs::read_to_string(path.join(MARKER)) else {
                continue;
            };
            if is_spill_dir && owner_is_gone(&marker, &host) {
                removed += clean(&path);
            }
        }
        let mut dir = root.join(dir_name(worker_id));
        if dir.join(MARKER).exists() {
            // A live worker of the same id (another local cluster, say) spills there.
            dir = root.join(format!("{}.{}", dir_name(worker_id), std::process::id()));
        }
        if removed > 0 {
            tracing::info!(root = %root.display(), removed, "removed spill files left by earlier workers");
        }
        std::fs::create_dir_all(&dir).map_err(|e| prepare(&dir, e))?;
        std::fs::write(dir.join(MARKER), marker(&host, worker_id)).map_err(|e| prepare(&dir, e))?;
        Ok(SpillDir {
            dir,
            next: AtomicU64::new(0),
        })
    }

    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// Writes `batch` as an Arrow IPC stream into a new spill file.
    pub fn write(&self, batch: &RecordBatch) -> Result<SpillFile, SpillError> {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let path = self.dir.join(format!("{FILE_PREFIX}{n:010}{FILE_SUFFIX}"));
        let failed = |detail: String| SpillError::Write {
            path: path.clone(),
            detail,
        };
        let file = File::create(&path).map_err(|e| failed(e.to_string()))?;
        // From here on the file is removed if anything fails.
        let mut spilled = SpillFile {
            path: path.clone(),
            bytes: 0,
        };
        let mut writer =
            StreamWriter::try_new(BufWriter::with_capacity(1 << 20, file), &batch.schema())
                .map_err(|e| failed(e.to_string()))?;
        // The IPC writer encodes each batch into one buffer before writing it: slices keep
        // that copy small while the pool is already full.
        let rows = batch.num_rows();
        let slice_rows = slice_rows(batch);
        let mut offset = 0;
        loop {
            let length = slice_rows.min(rows - offset);
            writer
                .write(&batch.slice(offset, length))
                .map_err(|e| failed(e.to_string()))?;
            offset += length;
            if offset >= rows {
                break;
            }
        }
        writer.finish().map_err(|e| failed(e.to_string()))?;
        let file = writer
            .into_inner()
            .map_err(|e| failed(e.to_string()))?
            .into_inner()
            .map_err(|e| failed(e.to_string()))?;
        spilled.bytes = file.metadata().map_err(|e| failed(e.to_string()))?.len();
        Ok(spilled)
    }
}

impl Drop for SpillDir {
    fn drop(&mut self) {
        clean(&self.dir);
    }
}

/// Rows per slice written: about 4 MiB of the batch.
fn slice_rows(batch: &RecordBatch) -> usize {
    let bytes = batch.get_array_memory_size().max(1);
    let rows = batch.num_rows().max(1);
    ((4usize << 20) * rows / bytes).clamp(1024, rows.max(1024))
}

/// One spilled partition on disk; the file is removed when this is dropped.
#[derive(Debug)]
pub struct SpillFile {
    path: PathBuf,
    bytes: u64,
}

impl SpillFile {
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The file's size.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    fn read_err(&self, detail: impl ToString) -> SpillError {
        SpillError::Read {
            path: self.path.clone(),
            detail: detail.to_string(),
        }
    }

    /// Reads the partition back.
    pub fn read(&self) -> Result<RecordBatch, SpillError> {
        let file = File::open(&self.path).map_err(|e| self.read_err(e))?;
        let reader = StreamReader::try_new(BufReader::with_capacity(1 << 20, file), None)
            .map_err(|e| self.read_err(e))?;
        let schema = reader.schema();
        let batches = reader
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| self.read_err(e))?;
        if batches.len() == 1 {
            return batches
                .into_iter()
                .next()
                .ok_or_else(|| self.read_err("no batch"));
        }
        // Column by column, letting each column's slices go once combined: the partition is
        // held about once, not twice.
        let mut columns: Vec<Vec<ArrayRef>> =
            vec![Vec::with_capacity(batches.len()); schema.fields().len()];
        for batch in batches {
            for (column, array) in columns.iter_mut().zip(batch.columns()) {
                column.push(array.clone());
            }
        }
        let mut combined = Vec::with_capacity(columns.len());
        for parts in &mut columns {
            let refs: Vec<&dyn Array> = parts.iter().map(|a| a.as_ref()).collect();
            combined.push(arrow::compute::concat(&refs).map_err(|e| self.read_err(e))?);
            parts.clear();
        }
        RecordBatch::try_new(schema, combined).map_err(|e| self.read_err(e))
    }

    /// The file's bytes: an Arrow IPC stream, as peers receive partitions.
    pub fn read_bytes(&self) -> Result<Vec<u8>, SpillError> {
        let mut bytes = Vec::with_capacity(self.bytes as usize);
        File::open(&self.path)
            .and_then(|mut f| f.read_to_end(&mut bytes))
            .map_err(|e| self.read_err(e))?;
        Ok(bytes)
    }
}

impl Drop for SpillFile {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_file(&self.path)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(path = %self.path.display(), "cannot remove spill file: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Int64Array, StringArray};
    use std::sync::Arc;

    fn batch() -> RecordBatch {
        RecordBatch::try_from_iter([
            (
                "x",
                Arc::new(Int64Array::from(vec![Some(1), None, Some(3)])) as _,
            ),
            ("s", Arc::new(StringArray::from(vec!["a", "b", "c"])) as _),
        ])
        .unwrap()
    }

    #[test]
    fn a_spilled_batch_reads_back_and_its_file_goes_with_it() {
        let root = tempfile::tempdir().unwrap();
        let dir = SpillDir::open(root.path(), "w/1").unwrap();
        assert!(dir.path().ends_with("wrk-spill-w_1"));
        let file = dir.write(&batch()).unwrap();
        assert!(file.bytes() > 0);
        assert_eq!(file.read().unwrap(), batch());
        assert_eq!(
            crate::table::decode_ipc(&file.read_bytes().unwrap()).unwrap(),
            batch(),
            "the file is an IPC stream as peers receive it"
        );
        let path = file.path().to_path_buf();
        assert!(path.exists());
        drop(file);
        assert!(!path.exists());
    }

    #[test]
    fn a_large_batch_is_written_in_slices_and_read_back_whole() {
        let root = tempfile::tempdir().unwrap();
        let dir = SpillDir::open(root.path(), "w").unwrap();
        let rows = 1_000_000;
        let big = RecordBatch::try_from_iter([(
            "x",
            Arc::new(Int64Array::from_iter(
                (0..rows).map(|i| (i % 3 != 0).then_some(i)),
            )) as _,
        )])
        .unwrap();
        assert!(slice_rows(&big) < rows as usize);
        let file = dir.write(&big).unwrap();
        assert_eq!(file.read().unwrap(), big);
        // An empty batch survives too.
        let empty = big.slice(0, 0);
        assert_eq!(dir.write(&empty).unwrap().read().unwrap(), empty);
    }

    #[test]
    fn a_live_worker_of_the_same_id_keeps_its_directory() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("wrk-spill-w");
        std::fs::create_dir_all(&dir).unwrap();
        let start = process_start(1).unwrap();
        std::fs::write(dir.join(MARKER), format!("{} 1 {start} w\n", host_name())).unwrap();
        std::fs::write(dir.join("part-0000000000.arrows"), b"x").unwrap();
        let ours = SpillDir::open(root.path(), "w").unwrap();
        assert_ne!(ours.path(), dir);
        assert!(dir.join("part-0000000000.arrows").exists());
    }

    #[test]
    fn start_cleans_own_and_dead_workers_leftovers_only() {
        let root = tempfile::tempdir().unwrap();
        // A previous run of this worker crashed with a spill file in place.
        let first = SpillDir::open(root.path(), "w1").unwrap();
        let leftover = first.write(&batch()).unwrap();
        let leftover_path = leftover.path().to_path_buf();
        std::mem::forget(leftover);
        // Beside it: a dead worker of this host, a live one, another host's, and a directory
        // that is not a spill directory at all.
        let host = host_name();
        let make = |name: &str, marker: Option<String>| {
            let dir = root.path().join(name);
            std::fs::create_dir_all(&dir).unwrap();
            if let Some(marker) = marker {
                std::fs::write(dir.join(MARKER), marker).unwrap();
            }
            std::fs::write(dir.join("part-0000000000.arrows"), b"x").unwrap();
            dir
        };
        let dead = make("wrk-spill-dead", Some(format!("{host} 4294967 5 dead\n")));
        // A restarted container's first process: the same number, another start.
        let me = std::process::id();
        let restarted = make("wrk-spill-old", Some(format!("{host} {me} 1 old\n")));
        let start = process_start(1).unwrap();
        let live = make("wrk-spill-live", Some(format!("{host} 1 {start} live\n")));
        // Another worker of this very process (a local cluster).
        let sibling = make("wrk-spill-sibling", Some(marker(&host, "sibling")));
        let remote = make(
            "wrk-spill-remote",
            Some("another-host 4294967 5 r\n".into()),
        );
        let foreign = make("wrk-spill-foreign", None);
        std::fs::write(first.path().join("notes.txt"), b"keep").unwrap();

        // The crash: the directory stays, and its marker names a process that is gone (the
        // same number as this one, as in a restarted container, but another start).
        let first_path = first.path().to_path_buf();
        std::mem::forget(first);
        std::fs::write(first_path.join(MARKER), format!("{host} {me} 1 w1\n")).unwrap();
        let again = SpillDir::open(root.path(), "w1").unwrap();
        assert_eq!(again.path(), first_path);
        assert!(!leftover_path.exists(), "this worker's leftover is gone");
        assert!(
            again.path().join("notes.txt").exists(),
            "files wrk did not write stay"
        );
        assert!(again.path().join(MARKER).exists());
        assert!(!dead.exists(), "a dead worker's directory is gone");
        assert!(!restarted.exists(), "so is the last container's");
        for kept in [&live, &sibling, &remote, &foreign] {
            assert!(
                kept.join("part-0000000000.arrows").exists(),
                "{} is kept",
                kept.display()
            );
        }
    }
}
