"""The `.kvc` container format v1 (spec/kvc-v1.md): reader, writer, lossless stages."""

from kvcodec.errors import KvcUnknownCodecError
from kvcodec.format.container import MAGIC, VERSION_MAJOR, VERSION_MINOR, IndexEntry
from kvcodec.codecs.lossless import Raw, Shuffle, Zstd, lossless_pipeline, raw_pipeline
from kvcodec.format.header import AttachmentInfo, BlobInfo, KvcHeader
from kvcodec.format.reader import KvcReader, read_kvc, verify_kvc
from kvcodec.format.writer import ExternalAttachment, WriteOptions, array_sha256, encode_kvc_bytes, write_kvc, write_kvc_stream

__all__ = [
    "MAGIC", "VERSION_MAJOR", "VERSION_MINOR", "IndexEntry", "KvcUnknownCodecError",
    "Raw", "Shuffle", "Zstd", "lossless_pipeline", "raw_pipeline",
    "AttachmentInfo", "BlobInfo", "KvcHeader", "KvcReader", "read_kvc", "verify_kvc",
    "ExternalAttachment", "WriteOptions", "array_sha256", "encode_kvc_bytes", "write_kvc", "write_kvc_stream",
]
