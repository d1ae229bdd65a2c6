//! Parquet datasets: listing a source's files, planning partitions by row groups toward a target
//! size, reading a partition (with column projection and row-group selection) and writing a table
//! to a sink.
//!
//! A source or sink is a local file or directory; every error names the file and the cause.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow::datatypes::SchemaRef;
use arrow::record_batch::RecordBatch;
use arrow::record_batch::RecordBatchReader;
use parquet::arrow::ArrowWriter;
use parquet::arrow::ProjectionMask;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::metadata::ParquetMetaData;
use parquet::file::properties::WriterProperties;
use parquet::file::reader::{FileReader, SerializedFileReader};
use wrk_proto::{FileSlice, ParquetPartition};

use crate::expr::Expr;

/// Rows per batch while decoding Parquet (the batches are concatenated into one table).
const READ_BATCH_ROWS: usize = 8192;

/// Default target size of one input partition (uncompressed), as in the brief.
pub const DEFAULT_PARTITION_BYTES: u64 = 256 * 1024 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum IoError {
    #[error("cannot read `{path}`: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("`{path}` is not a readable Parquet file: {source}")]
    Parquet {
        path: PathBuf,
        source: parquet::errors::ParquetError,
    },
    #[error("`{path}` has no column `{column}` (it has: {available})")]
    UnknownColumn {
        path: PathBuf,
        column: String,
        available: String,
    },
    #[error("`{path}` has {available} row groups; row group {requested} does not exist")]
    NoSuchRowGroup {
        path: PathBuf,
        requested: u32,
        available: usize,
    },
    #[error("source `{source_uri}` has no Parquet files")]
    EmptySource { source_uri: String },
    #[error(
        "`{path}` has columns ({found}) but `{first}` has ({expected}): a dataset's files must share one schema"
    )]
    SchemaMismatch {
        path: PathBuf,
        first: PathBuf,
        found: String,
        expected: String,
    },
    #[error("cannot write `{path}`: {detail}")]
    Write { path: PathBuf, detail: String },
    #[error("the files of one partition do not combine into one table: {detail}")]
    Combine { detail: String },
    #[error(
        "`{uri}` is neither a local path nor an object store URL (s3://, gs://, az://, http(s)://)"
    )]
    UnsupportedUri { uri: String },
    #[error("object store: {0}")]
    Remote(#[from] crate::remote::RemoteError),
}

/// One Parquet file of a source: its name (a path or an object URL) and a local file holding its
/// bytes (the file itself, or the object downloaded into the cache).
#[derive(Debug, Clone)]
pub struct SourceFile {
    pub uri: String,
    pub path: PathBuf,
}

/// Where downloaded source objects are cached: `$WRK_OBJECT_CACHE`, else `objects` beside the
/// component cache, else the temporary directory.
fn object_cache() -> PathBuf {
    if let Some(dir) = std::env::var_os("WRK_OBJECT_CACHE") {
        return PathBuf::from(dir);
    }
    crate::engine::default_cache_dir()
        .and_then(|components| components.parent().map(|wrk| wrk.join("objects")))
        .unwrap_or_else(|| std::env::temp_dir().join("wrk-objects"))
}

/// A local file holding the Parquet file `uri` (downloading it when it is an object URL).
fn resolve(uri: &str) -> Result<PathBuf, IoError> {
    if crate::remote::is_remote(uri) {
        return Ok(crate::remote::fetch(uri, &object_cache())?);
    }
    local_path(uri)
}

fn local_path(uri: &str) -> Result<PathBuf, IoError> {
    if let Some(path) = uri.strip_prefix("file://") {
        return Ok(PathBuf::from(path));
    }
    if uri.contains("://") {
        return Err(IoError::UnsupportedUri {
            uri: uri.to_string(),
        });
    }
    Ok(PathBuf::from(uri))
}

/// The Parquet files of a source: the file itself, or a directory's `*.parquet` files (recursively)
/// in path order.
pub fn list_files(uri: &str) -> Result<Vec<SourceFile>, IoError> {
    if crate::remote::is_remote(uri) {
        let objects = crate::remote::list(uri)?;
        if objects.is_empty() {
            return Err(IoError::EmptySource {
                source_uri: uri.to_string(),
            });
        }
        return objects
            .into_iter()
            .map(|object| {
                let path = resolve(&object)?;
                Ok(SourceFile { uri: object, path })
            })
            .collect();
    }
    Ok(list_local_files(uri)?
        .into_iter()
        .map(|path| SourceFile {
            uri: path.to_string_lossy().into_owned(),
            path,
        })
        .collect())
}

fn list_local_files(uri: &str) -> Result<Vec<PathBuf>, IoError> {
    let root = local_path(uri)?;
    let metadata = std::fs::metadata(&root).map_err(|source| IoError::Read {
        path: root.clone(),
        source,
    })?;
    if metadata.is_file() {
        return Ok(vec![root]);
    }
    let mut files = Vec::new();
    let mut pending = vec![root];
    while let Some(dir) = pending.pop() {
        let entries = std::fs::read_dir(&dir).map_err(|source| IoError::Read {
            path: dir.clone(),
            source,
        })?;
        for entry in entries {
            let entry = entry.map_err(|source| IoError::Read {
                path: dir.clone(),
                source,
            })?;
            let path = entry.path();
            if path.is_dir() {
                pending.push(path);
            } else if path.extension().is_some_and(|e| e == "parquet") {
                files.push(path);
            }
        }
    }
    files.sort();
    if files.is_empty() {
        return Err(IoError::EmptySource {
            source_uri: uri.to_string(),
        });
    }
    Ok(files)
}

fn open(path: &Path) -> Result<File, IoError> {
    File::open(path).map_err(|source| IoError::Read {
        path: path.to_path_buf(),
        source,
    })
}

fn metadata(path: &Path) -> Result<Arc<ParquetMetaData>, IoError> {
    let reader = SerializedFileReader::new(open(path)?).map_err(|source| IoError::Parquet {
        path: path.to_path_buf(),
        source,
    })?;
    Ok(Arc::new(reader.metadata().clone()))
}

/// Splits a source into partitions of whole row groups, each close to `target_bytes` of
/// uncompressed data in the projected `columns` (all columns when empty). Row groups never span
/// partitions; a partition never spans files.
pub fn plan_partitions(
    uri: &str,
    columns: &[String],
    target_bytes: u64,
) -> Result<Vec<ParquetPartition>, IoError> {
    let files = list_files(uri)?;
    let mut partitions = Vec::new();
    let mut first_schema: Option<(PathBuf, Vec<String>)> = None;
    for SourceFile { uri, path } in files {
        let meta = metadata(&path)?;
        let schema = meta.file_metadata().schema_descr();
        let names: Vec<String> = schema
            .columns()
            .iter()
            .map(|c| c.name().to_string())
            .collect();
        match &first_schema {
            None => first_schema = Some((path.clone(), names.clone())),
            Some((first, expected)) if *expected != names => {
                return Err(IoError::SchemaMismatch {
                    path,
                    first: first.clone(),
                    found: names.join(", "),
                    expected: expected.join(", "),
                });
            }
            Some(_) => {}
        }
        let projected: Vec<usize> = if columns.is_empty() {
            (0..names.len()).collect()
        } else {
            columns
                .iter()
                .map(|c| {
                    names
                        .iter()
                        .position(|n| n == c)
                        .ok_or_else(|| IoError::UnknownColumn {
                            path: path.clone(),
                            column: c.clone(),
                            available: names.join(", "),
                        })
                })
                .collect::<Result<_, _>>()?
        };
        let mut current = ParquetPartition {
            files: vec![FileSlice {
                uri: uri.clone(),
                row_groups: vec![],
            }],
            columns: columns.to_vec(),
            estimated_bytes: 0,
            rows: 0,
        };
        for (index, group) in meta.row_groups().iter().enumerate() {
            let bytes: i64 = projected
                .iter()
                .map(|&c| group.column(c).uncompressed_size())
                .sum();
            current.files[0].row_groups.push(index as u32);
            current.estimated_bytes += bytes.max(0) as u64;
            current.rows += group.num_rows().max(0) as u64;
            if current.estimated_bytes >= target_bytes {
                let next = ParquetPartition {
                    files: vec![FileSlice {
                        uri: uri.clone(),
                        row_groups: vec![],
                    }],
                    columns: columns.to_vec(),
                    estimated_bytes: 0,
                    rows: 0,
                };
                partitions.push(std::mem::replace(&mut current, next));
            }
        }
        if !current.files[0].row_groups.is_empty() {
            partitions.push(current);
        }
    }
    Ok(partitions)
}

/// Reads a partition into one batch.
pub fn read_partition(partition: &ParquetPartition) -> Result<RecordBatch, IoError> {
    let mut batches = Vec::with_capacity(partition.files.len());
    for slice in &partition.files {
        let path = resolve(&slice.uri)?;
        batches.push(read_file(
            &path,
            &partition.columns,
            Some(&slice.row_groups),
        )?);
    }
    concat_file_batches(batches)
}

/// Reads a source, optionally only some columns and row groups (numbered across the source's
/// files in path order), and only the rows where `predicate` holds: row groups whose statistics
/// rule the predicate out are skipped without being read.
pub fn read_source(
    uri: &str,
    columns: &[String],
    row_groups: Option<&[u32]>,
    predicate: Option<&Expr>,
) -> Result<RecordBatch, IoError> {
    // The predicate may read columns the caller did not ask for: read them too, drop them after.
    let requested = columns;
    let mut with_predicate_columns = columns.to_vec();
    if let Some(predicate) = predicate.filter(|_| !columns.is_empty()) {
        for column in predicate.columns() {
            if !with_predicate_columns.contains(&column) {
                with_predicate_columns.push(column);
            }
        }
    }
    let columns = with_predicate_columns.as_slice();
    let files = list_files(uri)?;
    let footers = files
        .iter()
        .map(|file| metadata(&file.path))
        .collect::<Result<Vec<_>, IoError>>()?;
    let counts: Vec<usize> = footers.iter().map(|m| m.num_row_groups()).collect();
    let total_groups: usize = counts.iter().sum();
    // Checked from the footers, before any data is read.
    if let Some(&bad) = row_groups.and_then(|all| all.iter().find(|&&g| g as usize >= total_groups))
    {
        return Err(IoError::NoSuchRowGroup {
            path: local_path(uri)?,
            requested: bad,
            available: total_groups,
        });
    }
    let mut batches = Vec::new();
    let mut first_group = 0u32;
    let (mut read_groups, mut skipped_groups) = (0usize, 0usize);
    for ((SourceFile { path, .. }, &groups), footer) in files.iter().zip(&counts).zip(&footers) {
        let mut wanted: Option<Vec<u32>> = row_groups.map(|all| {
            all.iter()
                .filter(|&&g| g >= first_group && g < first_group + groups as u32)
                .map(|&g| g - first_group)
                .collect()
        });
        if let Some(predicate) = predicate {
            let schema = parquet::arrow::parquet_to_arrow_schema(
                footer.file_metadata().schema_descr(),
                footer.file_metadata().key_value_metadata(),
            )
            .map_err(|source| IoError::Parquet {
                path: path.clone(),
                source,
            })?;
            let candidates = wanted.unwrap_or_else(|| (0..groups as u32).collect());
            let kept: Vec<u32> = candidates
                .iter()
                .copied()
                .filter(|&g| {
                    crate::prune::may_match(predicate, &schema, footer.row_group(g as usize))
                })
                .collect();
            skipped_groups += candidates.len() - kept.len();
            wanted = Some(kept);
        }
        read_groups += wanted.as_ref().map_or(groups, Vec::len);
        if wanted.as_ref().is_none_or(|w| !w.is_empty()) {
            batches.push(read_file(path, columns, wanted.as_deref())?);
        }
        first_group += groups as u32;
    }
    if predicate.is_some() {
        tracing::debug!(
            source = uri,
            read_groups,
            skipped_groups,
            "predicate pushdown"
        );
    }
    let batch = if batches.is_empty() {
        // Every row group was excluded: an empty table with the source's schema.
        read_file(&files[0].path, columns, Some(&[]))?
    } else {
        concat_file_batches(batches)?
    };
    let Some(predicate) = predicate else {
        return Ok(batch);
    };
    let combine = |e: crate::cpu::ops::OpError| IoError::Combine {
        detail: format!("filtering `{uri}`: {e}"),
    };
    let filtered = crate::cpu::ops::filter(&batch, predicate).map_err(combine)?;
    if requested.is_empty() || requested.len() == columns.len() {
        return Ok(filtered);
    }
    crate::cpu::ops::select(&filtered, requested).map_err(combine)
}

fn concat_file_batches(batches: Vec<RecordBatch>) -> Result<RecordBatch, IoError> {
    if batches.len() == 1 {
        return Ok(batches.into_iter().next().unwrap_or_else(|| unreachable!()));
    }
    let refs: Vec<&RecordBatch> = batches.iter().collect();
    crate::cpu::ops::concat(&refs).map_err(|e| IoError::Combine {
        detail: e.to_string(),
    })
}

fn read_file(
    path: &Path,
    columns: &[String],
    row_groups: Option<&[u32]>,
) -> Result<RecordBatch, IoError> {
    let parquet_err = |source| IoError::Parquet {
        path: path.to_path_buf(),
        source,
    };
    let mut builder = ParquetRecordBatchReaderBuilder::try_new(open(path)?).map_err(parquet_err)?;
    let available = builder.metadata().num_row_groups();
    if let Some(groups) = row_groups {
        if let Some(&bad) = groups.iter().find(|&&g| g as usize >= available) {
            return Err(IoError::NoSuchRowGroup {
                path: path.to_path_buf(),
                requested: bad,
                available,
            });
        }
        builder = builder.with_row_groups(groups.iter().map(|&g| g as usize).collect());
    }
    if !columns.is_empty() {
        let schema = builder.schema().clone();
        let indices = columns
            .iter()
            .map(|c| {
                schema.index_of(c).map_err(|_| IoError::UnknownColumn {
                    path: path.to_path_buf(),
                    column: c.clone(),
                    available: crate::expr::column_list(&schema),
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let mask = ProjectionMask::roots(builder.parquet_schema(), indices.iter().copied());
        builder = builder.with_projection(mask);
    }
    let rows: usize = match row_groups {
        Some(groups) => groups
            .iter()
            .map(|&g| builder.metadata().row_group(g as usize).num_rows().max(0) as usize)
            .sum(),
        None => builder
            .metadata()
            .row_groups()
            .iter()
            .map(|g| g.num_rows().max(0) as usize)
            .sum(),
    };
    let reader = builder
        // Small batches concatenated once beat one huge batch: every page of a fresh
        // multi-megabyte buffer faults on first touch, a small one is reused hot.
        .with_batch_size(rows.clamp(1, READ_BATCH_ROWS))
        .build()
        .map_err(parquet_err)?;
    let schema: SchemaRef = reader.schema();
    let batches = reader
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| parquet_err(parquet::errors::ParquetError::ArrowError(e.to_string())))?;
    let batches = if columns.is_empty() {
        batches
    } else {
        // Projection keeps file order: restore the order the caller asked for.
        batches
            .into_iter()
            .map(|b| {
                let order = columns
                    .iter()
                    .map(|c| b.schema().index_of(c))
                    .collect::<Result<Vec<_>, _>>()?;
                b.project(&order)
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| parquet_err(parquet::errors::ParquetError::ArrowError(e.to_string())))?
    };
    let schema = batches.first().map(|b| b.schema()).unwrap_or(schema);
    arrow::compute::concat_batches(&schema, &batches)
        .map_err(|e| parquet_err(parquet::errors::ParquetError::ArrowError(e.to_string())))
}

/// Writes `batch` as `<sink>/<name>.parquet` (zstd-compressed), creating the directory.
pub fn write_table(sink_uri: &str, name: &str, batch: &RecordBatch) -> Result<String, IoError> {
    if crate::remote::is_remote(sink_uri) {
        let staging = tempfile::Builder::new()
            .prefix("wrk-sink-")
            .tempdir()
            .map_err(|e| IoError::Write {
                path: std::env::temp_dir(),
                detail: e.to_string(),
            })?;
        let local = write_table(&staging.path().to_string_lossy(), name, batch)?;
        let object = format!("{}/{name}.parquet", sink_uri.trim_end_matches('/'));
        crate::remote::put(&object, Path::new(&local))?;
        return Ok(object);
    }
    let dir = local_path(sink_uri)?;
    let path = dir.join(format!("{name}.parquet"));
    let write_err = |detail: String| IoError::Write {
        path: path.clone(),
        detail,
    };
    std::fs::create_dir_all(&dir).map_err(|e| write_err(e.to_string()))?;
    write_file(&path, std::slice::from_ref(batch), 1 << 20)
        .map_err(|e| write_err(e.to_string()))?;
    Ok(path.to_string_lossy().into_owned())
}

/// Writes batches to one Parquet file with row groups of at most `row_group_rows` rows, through a
/// temporary file renamed into place so readers never see a partial file.
pub fn write_file(
    path: &Path,
    batches: &[RecordBatch],
    row_group_rows: usize,
) -> Result<(), IoError> {
    let write_err = |detail: String| IoError::Write {
        path: path.to_path_buf(),
        detail,
    };
    let Some(first) = batches.first() else {
        return Err(write_err("no data to write".into()));
    };
    let props = WriterProperties::builder()
        .set_compression(Compression::ZSTD(ZstdLevel::default()))
        .set_max_row_group_row_count(Some(row_group_rows.max(1)))
        .build();
    let partial = path.with_extension("parquet.partial");
    let file = File::create(&partial).map_err(|e| write_err(e.to_string()))?;
    let mut writer = ArrowWriter::try_new(file, first.schema(), Some(props))
        .map_err(|e| write_err(e.to_string()))?;
    for batch in batches {
        writer.write(batch).map_err(|e| write_err(e.to_string()))?;
    }
    writer.close().map_err(|e| write_err(e.to_string()))?;
    std::fs::rename(&partial, path).map_err(|e| write_err(e.to_string()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Float64Array, Int64Array};
    use arrow::datatypes::{DataType, Field, Schema};

    fn batch(start: i64, rows: i64) -> RecordBatch {
        let schema = Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("x", DataType::Float64, false),
        ]);
        RecordBatch::try_new(
            Arc::new(schema),
            vec![
                Arc::new(Int64Array::from_iter_values(start..start + rows)),
                Arc::new(Float64Array::from_iter_values(
                    (start..start + rows).map(|v| v as f64 * 0.5),
                )),
            ],
        )
        .unwrap()
    }

    #[test]
    fn plans_partitions_by_row_groups_and_reads_them_back() {
        let dir = tempfile::tempdir().unwrap();
        write_file(&dir.path().join("a.parquet"), &[batch(0, 1000)], 100).unwrap();
        write_file(&dir.path().join("b.parquet"), &[batch(1000, 500)], 100).unwrap();
        let uri = dir.path().to_string_lossy();
        let all = plan_partitions(&uri, &[], 1).unwrap();
        assert_eq!(
            all.len(),
            15,
            "one partition per row group when the target is tiny"
        );
        let big = plan_partitions(&uri, &[], u64::MAX).unwrap();
        assert_eq!(big.len(), 2, "a partition never spans files");
        let total: usize = big
            .iter()
            .map(|p| read_partition(p).unwrap().num_rows())
            .sum();
        assert_eq!(total, 1500);

        let projected = ParquetPartition {
            columns: vec!["x".into()],
            ..all[3].clone()
        };
        let b = read_partition(&projected).unwrap();
        assert_eq!(b.num_columns(), 1);
        assert_eq!(b.num_rows(), 100);
        let x = b.column(0).as_any().downcast_ref::<Float64Array>().unwrap();
        assert_eq!(x.value(0), 150.0);
    }

    #[test]
    fn read_source_counts_row_groups_across_files() {
        let dir = tempfile::tempdir().unwrap();
        write_file(&dir.path().join("a.parquet"), &[batch(0, 200)], 100).unwrap();
        write_file(&dir.path().join("b.parquet"), &[batch(200, 200)], 100).unwrap();
        let uri = dir.path().to_string_lossy();
        let b = read_source(&uri, &["id".into()], Some(&[1, 2]), None).unwrap();
        let ids = b.column(0).as_any().downcast_ref::<Int64Array>().unwrap();
        assert_eq!(
            (ids.value(0), ids.value(199), b.num_rows()),
            (100, 299, 200)
        );
        let err = read_source(&uri, &[], Some(&[9]), None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("row group 9 does not exist"), "{err}");
    }

    #[test]
    fn predicates_skip_row_groups_by_statistics_and_filter_rows() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.parquet");
        write_file(&path, &[batch(0, 400)], 100).unwrap();
        let at_least = |v: i64| Expr::Binary {
            op: crate::guest_api::wit::BinaryOp::Ge,
            lhs: Arc::new(Expr::col("id")),
            rhs: Arc::new(Expr::Literal(crate::expr::Literal::Int64(v))),
        };
        let footer = metadata(&path).unwrap();
        let schema = parquet::arrow::parquet_to_arrow_schema(
            footer.file_metadata().schema_descr(),
            footer.file_metadata().key_value_metadata(),
        )
        .unwrap();
        let kept: Vec<bool> = (0..4)
            .map(|g| crate::prune::may_match(&at_least(250), &schema, footer.row_group(g)))
            .collect();
        assert_eq!(kept, [false, false, true, true]);

        let uri = dir.path().to_string_lossy();
        let b = read_source(&uri, &["x".into()], None, Some(&at_least(250))).unwrap();
        assert_eq!(
            (b.num_rows(), b.num_columns()),
            (150, 1),
            "projected back to `x`"
        );
        let x = b.column(0).as_any().downcast_ref::<Float64Array>().unwrap();
        assert_eq!(
            x.value(0),
            125.0,
            "x = id / 2 of the first row kept, id 250"
        );
        let none = read_source(&uri, &[], None, Some(&at_least(1000))).unwrap();
        assert_eq!((none.num_rows(), none.num_columns()), (0, 2));
    }

    #[test]
    fn corrupt_file_and_unknown_column_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let bad = dir.path().join("bad.parquet");
        std::fs::write(&bad, b"PAR1 this is not parquet").unwrap();
        let err = read_source(&bad.to_string_lossy(), &[], None, None)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("bad.parquet") && err.contains("not a readable Parquet file"),
            "{err}"
        );

        let good = dir.path().join("good.parquet");
        write_file(&good, &[batch(0, 10)], 100).unwrap();
        let err = plan_partitions(&good.to_string_lossy(), &["nope".into()], 1)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("good.parquet") && err.contains("`nope`") && err.contains("id, x"),
            "{err}"
        );
    }
}
