//! Host-side tables and columns: what a guest's `table` and `column` handles point at.
//!
//! A table is an immutable Arrow `RecordBatch` behind an `Arc`, so handing a table to another
//! task, the partition store or a peer never copies its buffers.

use std::sync::Arc;

use std::io::Cursor;

use arrow::array::ArrayRef;
use arrow::buffer::Buffer;
use arrow::datatypes::SchemaRef;
use arrow::error::ArrowError;
use arrow::ipc::reader::{StreamDecoder, StreamReader};
use arrow::ipc::writer::{StreamEncoder, StreamWriter};
use arrow::record_batch::RecordBatch;

/// An immutable columnar table held by the worker.
#[derive(Debug, Clone)]
pub struct Table {
    batch: Arc<RecordBatch>,
    /// Whether every task of the worker that reads this input gets this same table (a
    /// broadcast input): work derived from it alone, such as a join's hash index, is worth
    /// keeping for the other tasks.
    shared: bool,
}

impl Table {
    pub fn new(batch: RecordBatch) -> Self {
        Table {
            batch: Arc::new(batch),
            shared: false,
        }
    }

    /// The same table, marked as shared by the worker's tasks.
    pub fn into_shared(self) -> Self {
        Table {
            shared: true,
            ..self
        }
    }

    pub fn is_shared(&self) -> bool {
        self.shared
    }

    pub fn batch(&self) -> &RecordBatch {
        &self.batch
    }

    pub fn schema(&self) -> SchemaRef {
        self.batch.schema()
    }

    pub fn num_rows(&self) -> usize {
        self.batch.num_rows()
    }

    /// How many handles share this table (the store, tasks, transfers): 1 means only its
    /// current holder has it.
    pub fn holders(&self) -> usize {
        Arc::strong_count(&self.batch)
    }

    /// Bytes of the Arrow buffers this table references.
    pub fn memory_bytes(&self) -> usize {
        self.batch.get_array_memory_size()
    }
}

impl From<RecordBatch> for Table {
    fn from(batch: RecordBatch) -> Self {
        Table::new(batch)
    }
}

/// A named column: one Arrow array.
#[derive(Debug, Clone)]
pub struct Column {
    pub name: String,
    pub array: ArrayRef,
}

impl Column {
    pub fn new(name: impl Into<String>, array: ArrayRef) -> Self {
        Column {
            name: name.into(),
            array,
        }
    }
}

/// Encodes a batch as an Arrow IPC stream: the format of explicit guest copies and of transfers
/// between workers.
pub fn encode_ipc(batch: &RecordBatch) -> Result<Vec<u8>, ArrowError> {
    let mut writer = StreamWriter::try_new(Vec::new(), &batch.schema())?;
    writer.write(batch)?;
    writer.into_inner()
}

/// One batch as an Arrow IPC stream made of the batch's own buffers (not copied) between the
/// messages' headers: what goes over the wire to peers, written with vectored writes or sent
/// chunk by chunk.
pub fn ipc_segments(batch: &RecordBatch) -> Result<Vec<Buffer>, ArrowError> {
    let mut encoder = StreamEncoder::try_new(&batch.schema())?;
    let mut segments = encoder.encode(batch)?;
    segments.extend(encoder.finish()?);
    Ok(segments)
}

/// Decodes an Arrow IPC stream held in `buffer` into one batch whose columns stay in `buffer`
/// (no copy when the stream's buffers are aligned, as our encoder writes them). A stream of
/// several batches is concatenated; one of none is an empty batch of its schema.
pub fn decode_ipc_buffer(mut buffer: Buffer) -> Result<RecordBatch, ArrowError> {
    let mut decoder = StreamDecoder::new();
    let mut batches = Vec::new();
    while !buffer.is_empty() {
        match decoder.decode(&mut buffer)? {
            Some(batch) => batches.push(batch),
            None if buffer.is_empty() => break,
            None => {}
        }
    }
    decoder.finish()?;
    match (batches.len(), decoder.schema()) {
        (1, _) => Ok(batches.remove(0)),
        (_, Some(schema)) => arrow::compute::concat_batches(&schema, &batches),
        (_, None) => Err(ArrowError::IpcError(
            "the stream ends before its schema".into(),
        )),
    }
}

/// Decodes an Arrow IPC stream into one batch.
pub fn decode_ipc(bytes: &[u8]) -> Result<RecordBatch, ArrowError> {
    let reader = StreamReader::try_new(Cursor::new(bytes), None)?;
    let schema = reader.schema();
    let batches = reader.collect::<Result<Vec<_>, _>>()?;
    arrow::compute::concat_batches(&schema, &batches)
}

#[cfg(test)]
mod tests {
    use arrow::array::{Int64Array, StringArray};

    use super::*;

    fn batch(rows: i64) -> RecordBatch {
        RecordBatch::try_from_iter([
            (
                "k",
                Arc::new(Int64Array::from_iter_values(0..rows)) as ArrayRef,
            ),
            (
                "s",
                Arc::new(StringArray::from_iter_values(
                    (0..rows).map(|i| format!("s{i}")),
                )),
            ),
        ])
        .unwrap()
    }

    fn joined(segments: &[Buffer]) -> Buffer {
        Buffer::from(
            segments
                .iter()
                .flat_map(|s| s.to_vec())
                .collect::<Vec<u8>>(),
        )
    }

    #[test]
    fn segments_are_the_tables_own_buffers_and_decode_back_equal_in_place() {
        let batch = batch(10_000);
        let segments = ipc_segments(&batch).unwrap();
        let keys = batch.column(0).to_data().buffers()[0].clone();
        assert!(
            segments.iter().any(|s| s.as_ptr() == keys.as_ptr()),
            "the key column's buffer is sent as it is, not copied"
        );
        let stream = joined(&segments);
        let decoded = decode_ipc_buffer(stream.clone()).unwrap();
        assert_eq!(decoded, batch);
        let decoded_keys = decoded.column(0).to_data().buffers()[0].clone();
        let within = stream.as_ptr() as usize..stream.as_ptr() as usize + stream.len();
        assert!(
            within.contains(&(decoded_keys.as_ptr() as usize)),
            "the decoded keys point into the received buffer"
        );
        assert_eq!(decode_ipc(stream.as_slice()).unwrap(), batch);
        // A sliced table goes out as just its rows.
        let sliced = batch.slice(9_990, 10);
        let stream = joined(&ipc_segments(&sliced).unwrap());
        assert!(stream.len() < 2_000, "{} bytes for 10 rows", stream.len());
        assert_eq!(decode_ipc_buffer(stream).unwrap(), sliced);
    }

    #[test]
    fn streams_of_several_batches_or_none_decode_to_one_batch() {
        let (first, second) = (batch(3), batch(5));
        let mut writer = StreamWriter::try_new(Vec::new(), &first.schema()).unwrap();
        writer.write(&first).unwrap();
        writer.write(&second).unwrap();
        let two = writer.into_inner().unwrap();
        let decoded = decode_ipc_buffer(Buffer::from(two)).unwrap();
        assert_eq!(decoded.num_rows(), 8);
        assert_eq!(decoded.slice(3, 5), second);

        let writer = StreamWriter::try_new(Vec::new(), &first.schema()).unwrap();
        let none = writer.into_inner().unwrap();
        let decoded = decode_ipc_buffer(Buffer::from(none)).unwrap();
        assert_eq!((decoded.num_rows(), decoded.schema()), (0, first.schema()));

        let truncated = joined(&ipc_segments(&first).unwrap()).slice_with_length(0, 20);
        decode_ipc_buffer(truncated).unwrap_err();
    }
}
