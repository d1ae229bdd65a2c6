//! Parquet datasets: listing a source's files, planning partitions by row groups toward a target
//! size, reading a partition (with column projection and row-group selection) and writing a table
//! to a sink.
//!
//! A source or sink is a local file or directory, or an object store URL (`remote`); every error
//! names the file and the cause.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use arrow::record_batch::RecordBatch;
use parquet::DecodeResult;
use parquet::arrow::ArrowWriter;
use parquet::arrow::ProjectionMask;
use parquet::arrow::arrow_reader::{
    ArrowReaderBuilder, ArrowReaderMetadata, ArrowReaderOptions, ParquetRecordBatchReaderBuilder,
};
use parquet::arrow::push_decoder::ParquetPushDecoderBuilder;
use parquet::basic::{Compression, Encoding, ZstdLevel};
use parquet::errors::ParquetError;
use parquet::file::metadata::{
    ColumnChunkMetaData, ParquetMetaData, ParquetMetaDataPushDecoder, ParquetMetaDataReader,
};
use parquet::file::properties::WriterProperties;
use wrk_proto::{FileSlice, ParquetPartition};

use crate::cpu::{dictionary, pooled};
use crate::expr::Expr;
use crate::object_cache::ObjectCache;

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
    #[error("WRK_OBJECT_CACHE_BYTES=`{value}` is not a size (`20GiB`, `0` for no cache): {detail}")]
    CacheSize { value: String, detail: String },
}

/// One Parquet file of a source: its name (a path or an object URL) and where its bytes are.
struct SourceFile {
    uri: String,
    location: Location,
}

enum Location {
    Local(PathBuf),
    /// Read by byte ranges through the object cache.
    Remote(crate::remote::RemoteObject),
}

impl SourceFile {
    fn open(uri: &str) -> Result<Self, IoError> {
        let location = if crate::remote::is_remote(uri) {
            Location::Remote(crate::remote::RemoteObject::open(uri, object_cache()?)?)
        } else {
            Location::Local(local_path(uri)?)
        };
        Ok(Self {
            uri: uri.to_string(),
            location,
        })
    }

    /// The name errors give: the local path, or the object's URL.
    fn name(&self) -> PathBuf {
        match &self.location {
            Location::Local(path) => path.clone(),
            Location::Remote(_) => PathBuf::from(&self.uri),
        }
    }

    fn parquet_error(&self, source: parquet::errors::ParquetError) -> IoError {
        IoError::Parquet {
            path: self.name(),
            source,
        }
    }
}

/// The cache of ranges read from object stores: in `$WRK_OBJECT_CACHE`, else `objects` beside the
/// component cache, else the temporary directory; holding at most `$WRK_OBJECT_CACHE_BYTES`
/// (a size such as `20GiB`; `0` turns caching off; 8 GiB by default).
fn object_cache() -> Result<ObjectCache, IoError> {
    let dir = match std::env::var_os("WRK_OBJECT_CACHE") {
        Some(dir) => PathBuf::from(dir),
        None => crate::engine::default_cache_dir()
            .and_then(|components| components.parent().map(|wrk| wrk.join("objects")))
            .unwrap_or_else(|| std::env::temp_dir().join("wrk-objects")),
    };
    let capacity = match std::env::var("WRK_OBJECT_CACHE_BYTES") {
        Err(_) => crate::object_cache::DEFAULT_CAPACITY,
        Ok(text) => {
            text.trim()
                .parse::<bytesize::ByteSize>()
                .map_err(|detail| IoError::CacheSize {
                    value: text.clone(),
                    detail,
                })?
                .0
        }
    };
    Ok(ObjectCache::new(dir, capacity))
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
/// in path order; for an object store, the objects under the prefix.
fn list_files(uri: &str) -> Result<Vec<SourceFile>, IoError> {
    if crate::remote::is_remote(uri) {
        let objects = crate::remote::list(uri, &object_cache()?)?;
        if objects.is_empty() {
            return Err(IoError::EmptySource {
                source_uri: uri.to_string(),
            });
        }
        return Ok(objects
            .into_iter()
            .map(|object| SourceFile {
                uri: object.url().to_string(),
                location: Location::Remote(object),
            })
            .collect());
    }
    Ok(list_local_files(uri)?
        .into_iter()
        .map(|path| SourceFile {
            uri: path.to_string_lossy().into_owned(),
            location: Location::Local(path),
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

/// How many bytes at an object's end are read first for its footer: the usual footer in one
/// request (a larger one takes a second).
const FOOTER_PREFETCH: u64 = 64 * 1024;

/// A file's footer: its schema, row groups and their statistics.
fn metadata(file: &SourceFile) -> Result<Arc<ParquetMetaData>, IoError> {
    match &file.location {
        Location::Local(path) => {
            let meta = ParquetMetaDataReader::new()
                .parse_and_finish(&open(path)?)
                .map_err(|e| file.parquet_error(e))?;
            Ok(Arc::new(meta))
        }
        Location::Remote(object) => {
            let size = object.size();
            let mut decoder =
                ParquetMetaDataPushDecoder::try_new(size).map_err(|e| file.parquet_error(e))?;
            let tail = size.saturating_sub(FOOTER_PREFETCH)..size;
            let mut ranges = Vec::from([tail]);
            loop {
                let data = object.read_ranges(&ranges)?;
                decoder
                    .push_ranges(ranges, data)
                    .map_err(|e| file.parquet_error(e))?;
                match decoder.try_decode().map_err(|e| file.parquet_error(e))? {
                    DecodeResult::NeedsData(more) => ranges = more,
                    DecodeResult::Data(meta) => return Ok(Arc::new(meta)),
                    DecodeResult::Finished => {
                        return Err(file.parquet_error(ParquetError::General(
                            "the footer ended without metadata".into(),
                        )));
                    }
                }
            }
        }
    }
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
    for file in files {
        let meta = metadata(&file)?;
        let (uri, path) = (file.uri.clone(), file.name());
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
        let file = SourceFile::open(&slice.uri)?;
        let footer = metadata(&file)?;
        batches.push(read_file(
            &file,
            footer,
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
        .map(metadata)
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
    for ((file, &groups), footer) in files.iter().zip(&counts).zip(&footers) {
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
            .map_err(|e| file.parquet_error(e))?;
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
            batches.push(read_file(file, footer.clone(), columns, wanted.as_deref())?);
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
        read_file(&files[0], footers[0].clone(), columns, Some(&[]))?
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

/// Reads some `columns` (all when empty, in the order asked) and `row_groups` (all when `None`)
/// of one file whose footer is `footer`, into one batch.
fn read_file(
    file: &SourceFile,
    footer: Arc<ParquetMetaData>,
    columns: &[String],
    row_groups: Option<&[u32]>,
) -> Result<RecordBatch, IoError> {
    let parquet_err = |e| file.parquet_error(e);
    let arrow_err =
        |e: arrow::error::ArrowError| parquet_err(ParquetError::ArrowError(e.to_string()));
    let plain =
        ArrowReaderMetadata::try_new(footer, ArrowReaderOptions::new()).map_err(parquet_err)?;
    let footer = match dictionary_hint(&plain, columns, row_groups) {
        Some(hint) => ArrowReaderMetadata::try_new(
            plain.metadata().clone(),
            ArrowReaderOptions::new().with_schema(hint),
        )
        .map_err(parquet_err)?,
        None => plain,
    };
    // The schema of a read that selects no row, in the order asked.
    let empty_schema = if columns.is_empty() {
        footer.schema().clone()
    } else {
        let indices = column_indices(file, footer.schema(), columns)?;
        Arc::new(footer.schema().project(&indices).map_err(arrow_err)?)
    };
    let metadata = footer.metadata().clone();
    let expected_rows = match row_groups {
        Some(groups) => groups
            .iter()
            .filter_map(|&g| metadata.row_groups().get(g as usize))
            .map(|g| g.num_rows().max(0) as usize)
            .sum(),
        None => metadata.file_metadata().num_rows().max(0) as usize,
    };
    let mut decoded = Decoded {
        columns,
        expected_rows,
        first: None,
        appender: None,
    };
    match &file.location {
        Location::Local(path) => {
            let builder = ParquetRecordBatchReaderBuilder::new_with_metadata(open(path)?, footer);
            let reader = configure(file, builder, columns, row_groups)?
                .build()
                .map_err(parquet_err)?;
            for batch in reader {
                decoded.push(batch.map_err(arrow_err)?).map_err(arrow_err)?;
            }
        }
        Location::Remote(object) => {
            let builder = ParquetPushDecoderBuilder::new_with_metadata(footer);
            let mut decoder = configure(file, builder, columns, row_groups)?
                .build()
                .map_err(parquet_err)?;
            loop {
                match decoder.try_decode().map_err(parquet_err)? {
                    DecodeResult::NeedsData(ranges) => {
                        let data = object.read_ranges(&ranges)?;
                        decoder.push_ranges(ranges, data).map_err(parquet_err)?;
                    }
                    DecodeResult::Data(batch) => decoded.push(batch).map_err(arrow_err)?,
                    DecodeResult::Finished => break,
                }
            }
        }
    }
    decoded.finish(empty_schema).map_err(arrow_err)
}

/// A read's batches as the decoder yields them: each is appended to the partition's columns
/// and dropped at once (see [`pooled::BatchAppender`]); a read of a single batch keeps it as it
/// is.
struct Decoded<'a> {
    /// The columns asked for, in the order asked (all, in file order, when empty).
    columns: &'a [String],
    expected_rows: usize,
    first: Option<RecordBatch>,
    appender: Option<pooled::BatchAppender>,
}

impl Decoded<'_> {
    fn push(&mut self, batch: RecordBatch) -> Result<(), arrow::error::ArrowError> {
        // Projection keeps file order: restore the order the caller asked for.
        let batch = if self.columns.is_empty() {
            batch
        } else {
            let order = self
                .columns
                .iter()
                .map(|c| batch.schema().index_of(c))
                .collect::<Result<Vec<_>, _>>()?;
            batch.project(&order)?
        };
        if let Some(appender) = &mut self.appender {
            return appender.push(&batch);
        }
        match self.first.take() {
            None => self.first = Some(batch),
            Some(first) => {
                let mut appender = pooled::BatchAppender::new(first.schema(), self.expected_rows);
                appender.push(&first)?;
                appender.push(&batch)?;
                self.appender = Some(appender);
            }
        }
        Ok(())
    }

    /// The rows read, as one batch (`empty_schema` when there were none).
    fn finish(self, empty_schema: SchemaRef) -> Result<RecordBatch, arrow::error::ArrowError> {
        match (self.appender, self.first) {
            (Some(appender), _) => appender.finish(),
            (None, Some(first)) => Ok(first),
            (None, None) => Ok(RecordBatch::new_empty(empty_schema)),
        }
    }
}

/// The schema to read a file with when some of the string `columns` it reads (all when empty)
/// are dictionary encoded on every data page of the chosen `row_groups`: those columns typed
/// as [`dictionary::string_dictionary`], so the decoder keeps the keys instead of writing out
/// every row's bytes. `None` when there are none (a chunk that fell back to plain pages would
/// make the decoder rebuild a dictionary by hashing every value).
fn dictionary_hint(
    footer: &ArrowReaderMetadata,
    columns: &[String],
    row_groups: Option<&[u32]>,
) -> Option<SchemaRef> {
    let metadata = footer.metadata();
    let all_groups: Vec<u32>;
    let groups = match row_groups {
        Some(groups) => groups,
        None => {
            all_groups = (0..metadata.num_row_groups() as u32).collect();
            &all_groups
        }
    };
    let dictionary_encoded = |chunk: &ColumnChunkMetaData| {
        chunk.dictionary_page_offset().is_some()
            && chunk.page_encoding_stats_mask().is_some_and(|mask| {
                mask.is_only(Encoding::RLE_DICTIONARY) || mask.is_only(Encoding::PLAIN_DICTIONARY)
            })
    };
    let schema = footer.schema();
    let leaves = metadata.file_metadata().schema_descr();
    let mut fields: Vec<Arc<Field>> = schema.fields().iter().cloned().collect();
    let mut any = false;
    for (leaf, descriptor) in leaves.columns().iter().enumerate() {
        // Top-level string columns only: a nested leaf is not one Arrow field.
        let [name] = descriptor.path().parts() else {
            continue;
        };
        let Ok(index) = schema.index_of(name) else {
            continue;
        };
        let wanted = columns.is_empty() || columns.contains(name);
        if wanted
            && *fields[index].data_type() == DataType::Utf8
            && !groups.is_empty()
            && groups.iter().all(|&g| {
                metadata
                    .row_groups()
                    .get(g as usize)
                    .is_some_and(|group| dictionary_encoded(group.column(leaf)))
            })
        {
            fields[index] = Arc::new(
                fields[index]
                    .as_ref()
                    .clone()
                    .with_data_type(dictionary::string_dictionary()),
            );
            any = true;
        }
    }
    any.then(|| Arc::new(Schema::new_with_metadata(fields, schema.metadata().clone())))
}

/// Applies a read's row groups and projection to a reader of either kind, checking both against
/// the footer first.
fn configure<T>(
    file: &SourceFile,
    builder: ArrowReaderBuilder<T>,
    columns: &[String],
    row_groups: Option<&[u32]>,
) -> Result<ArrowReaderBuilder<T>, IoError> {
    let mut builder = builder;
    let available = builder.metadata().num_row_groups();
    if let Some(groups) = row_groups {
        if let Some(&bad) = groups.iter().find(|&&g| g as usize >= available) {
            return Err(IoError::NoSuchRowGroup {
                path: file.name(),
                requested: bad,
                available,
            });
        }
        builder = builder.with_row_groups(groups.iter().map(|&g| g as usize).collect());
    }
    if !columns.is_empty() {
        let indices = column_indices(file, builder.schema(), columns)?;
        let mask = ProjectionMask::roots(builder.parquet_schema(), indices);
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
    // Small batches concatenated once beat one huge batch: every page of a fresh multi-megabyte
    // buffer faults on first touch, a small one is reused hot.
    Ok(builder.with_batch_size(rows.clamp(1, READ_BATCH_ROWS)))
}

fn column_indices(
    file: &SourceFile,
    schema: &SchemaRef,
    columns: &[String],
) -> Result<Vec<usize>, IoError> {
    columns
        .iter()
        .map(|c| {
            schema.index_of(c).map_err(|_| IoError::UnknownColumn {
                path: file.name(),
                column: c.clone(),
                available: crate::expr::column_list(schema),
            })
        })
        .collect()
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
    // Outputs keep their value types: dictionary-encoded columns are written out.
    let batches = batches
        .iter()
        .map(dictionary::plain_batch)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| write_err(e.to_string()))?;
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
    for batch in &batches {
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

    /// A file of `id` and a `shift` string column (repeated values and nulls), its pages
    /// dictionary encoded or not.
    fn write_shifts(path: &Path, dictionary_pages: bool) {
        let shifts = ["day", "night", "dusk"];
        let batch = RecordBatch::try_from_iter([
            (
                "id",
                Arc::new(Int64Array::from_iter_values(0..300)) as arrow::array::ArrayRef,
            ),
            (
                "shift",
                Arc::new(arrow::array::StringArray::from_iter(
                    (0..300).map(|i| (i % 7 != 0).then_some(shifts[i % 3])),
                )),
            ),
        ])
        .unwrap();
        let props = WriterProperties::builder()
            .set_dictionary_enabled(dictionary_pages)
            .set_max_row_group_row_count(Some(100))
            .build();
        let mut writer =
            ArrowWriter::try_new(File::create(path).unwrap(), batch.schema(), Some(props)).unwrap();
        writer.write(&batch).unwrap();
        writer.close().unwrap();
    }

    #[test]
    fn dictionary_pages_are_read_as_dictionaries_and_written_out_as_strings() {
        let dir = tempfile::tempdir().unwrap();
        let (coded, plain) = (dir.path().join("a.parquet"), dir.path().join("b.parquet"));
        write_shifts(&coded, true);
        write_shifts(&plain, false);
        let read = |path: &Path, predicate: Option<&Expr>| {
            read_source(&path.to_string_lossy(), &["shift".into()], None, predicate).unwrap()
        };
        let from_coded = read(&coded, None);
        assert_eq!(
            from_coded.schema().field(0).data_type(),
            &dictionary::string_dictionary()
        );
        let from_plain = read(&plain, None);
        assert_eq!(from_plain.schema().field(0).data_type(), &DataType::Utf8);
        assert_eq!(dictionary::plain_batch(&from_coded).unwrap(), from_plain);
        // Both files as one source: the encodings differ, so the column is written out.
        let both = read(dir.path(), None);
        assert_eq!(both.schema().field(0).data_type(), &DataType::Utf8);
        assert_eq!(both.num_rows(), 600);
        assert_eq!(both.column(0).null_count(), 2 * 43);
        // A predicate on the encoded column.
        let day = Expr::Binary {
            op: crate::guest_api::wit::BinaryOp::Eq,
            lhs: Arc::new(Expr::Column("shift".into())),
            rhs: Arc::new(Expr::Literal(crate::expr::Literal::Utf8("day".into()))),
        };
        assert_eq!(
            read(&coded, Some(&day)).num_rows(),
            read(&plain, Some(&day)).num_rows()
        );
        // Written back, the column is a string column again.
        let out = dir.path().join("out.parquet");
        write_file(&out, &[from_coded], 100).unwrap();
        let footer = ParquetMetaDataReader::new()
            .parse_and_finish(&File::open(&out).unwrap())
            .unwrap();
        let schema = parquet::arrow::parquet_to_arrow_schema(
            footer.file_metadata().schema_descr(),
            footer.file_metadata().key_value_metadata(),
        )
        .unwrap();
        assert_eq!(schema.field(0).data_type(), &DataType::Utf8);
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
        let footer = metadata(&SourceFile::open(&path.to_string_lossy()).unwrap()).unwrap();
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

    /// A Parquet object of 100,000 rows in 10 row groups (`id`, `x` and a string column `s`)
    /// served over HTTP, and a cache of `capacity` bytes for reading it.
    fn served_object(
        capacity: u64,
    ) -> (
        tokio::runtime::Runtime,
        String,
        Arc<crate::remote::test_server::Objects>,
        tempfile::TempDir,
        ObjectCache,
    ) {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let (base, objects) = crate::remote::test_server::start(&runtime);
        let dir = tempfile::tempdir().unwrap();
        let local = dir.path().join("trips.parquet");
        let strings = arrow::array::StringArray::from_iter_values(
            (0..100_000u64).map(|i| format!("{:016x}", i.wrapping_mul(0x9e37_79b9_7f4a_7c15))),
        );
        let table = batch(0, 100_000)
            .project(&[0, 1])
            .and_then(|b| {
                let mut columns = b.columns().to_vec();
                columns.push(Arc::new(strings));
                RecordBatch::try_from_iter(["id", "x", "s"].into_iter().zip(columns))
            })
            .unwrap();
        write_file(&local, &[table], 10_000).unwrap();
        objects
            .bodies
            .lock()
            .unwrap()
            .insert("/trips.parquet".into(), std::fs::read(&local).unwrap());
        let cache = ObjectCache::new(dir.path().join("cache"), capacity);
        (
            runtime,
            format!("{base}/trips.parquet"),
            objects,
            dir,
            cache,
        )
    }

    fn open_remote(url: &str, cache: &ObjectCache) -> SourceFile {
        SourceFile {
            uri: url.to_string(),
            location: Location::Remote(
                crate::remote::RemoteObject::open(url, cache.clone()).unwrap(),
            ),
        }
    }

    #[test]
    fn remote_reads_fetch_only_the_selected_column_chunks_and_reuse_the_cache() {
        let (_runtime, url, objects, _dir, cache) = served_object(64 << 20);
        let size = objects.bodies.lock().unwrap()["/trips.parquet"].len() as u64;
        let file = open_remote(&url, &cache);
        let footer = metadata(&file).unwrap();
        assert_eq!(footer.num_row_groups(), 10);
        let read = read_file(&file, footer, &["x".into()], Some(&[3])).unwrap();
        let x = read
            .column(0)
            .as_any()
            .downcast_ref::<Float64Array>()
            .unwrap();
        assert_eq!((x.len(), x.value(0)), (10_000, 15_000.0));
        let (gets, sent) = (objects.gets(), objects.bytes_sent());
        assert!(
            sent < size / 5,
            "one column of one row group read {sent} of the object's {size} bytes"
        );

        // A second read of the same version: footer and chunk come from the cache.
        let again = open_remote(&url, &cache);
        let footer = metadata(&again).unwrap();
        let reread = read_file(&again, footer, &["x".into()], Some(&[3])).unwrap();
        assert_eq!(reread, read);
        assert_eq!(objects.gets(), gets, "no GET on a cache hit");

        // A changed object (another entity tag) is read afresh.
        let changed = {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("changed.parquet");
            write_file(&path, &[batch(7, 10)], 100).unwrap();
            std::fs::read(path).unwrap()
        };
        objects
            .bodies
            .lock()
            .unwrap()
            .insert("/trips.parquet".into(), changed);
        let fresh = open_remote(&url, &cache);
        let footer = metadata(&fresh).unwrap();
        let ids = read_file(&fresh, footer, &["id".into()], None).unwrap();
        let ids = ids.column(0).as_any().downcast_ref::<Int64Array>().unwrap();
        assert_eq!((ids.len(), ids.value(0)), (10, 7));
        assert!(objects.gets() > gets);
    }

    #[test]
    fn the_object_cache_stays_within_its_capacity() {
        let capacity = 300 * 1024;
        let (_runtime, url, objects, _dir, cache) = served_object(capacity);
        let cached_bytes = || -> u64 {
            std::fs::read_dir(_dir.path().join("cache"))
                .unwrap()
                .map(|e| e.unwrap().metadata().unwrap().len())
                .sum()
        };
        let file = open_remote(&url, &cache);
        let footer = metadata(&file).unwrap();
        for group in 0..10 {
            let read = read_file(&file, footer.clone(), &[], Some(&[group])).unwrap();
            assert_eq!(read.num_rows(), 10_000);
            let cached = cached_bytes();
            assert!(cached > 0 && cached <= capacity, "{cached} bytes cached");
        }
        // The first row groups were evicted: reading one again fetches it.
        let gets = objects.gets();
        read_file(&file, footer, &[], Some(&[0])).unwrap();
        assert!(objects.gets() > gets);
    }

    #[test]
    fn a_corrupt_object_is_named_by_its_url() {
        let (_runtime, url, objects, _dir, cache) = served_object(1 << 20);
        objects.bodies.lock().unwrap().insert(
            "/trips.parquet".into(),
            b"PAR1 not parquet at all PAR1".to_vec(),
        );
        let err = metadata(&open_remote(&url, &cache))
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains(&url) && err.contains("not a readable Parquet file"),
            "{err}"
        );
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
