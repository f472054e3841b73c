"""The KDN wire protocol's shared constants: paths, header names, the media type and size limits.

Why a module of its own: the server (:mod:`kvcodec.service`) and its client tier
(:mod:`kvcodec.store.tiers.kdn`) must agree on every one of these, and the service sits above the store in the
layers (docs/architecture.md), so neither can import the other's copy.  The protocol is normative in
``spec/kdn-v1.md``; this module only names its constants once.  It imports nothing.
"""

from __future__ import annotations

API = "/v1"  # every authenticated route is under this prefix
HEALTHZ = "/healthz"  # liveness + tier availability (no auth)
METRICS = "/metrics"  # Prometheus text format (no auth)
WHOAMI = f"{API}/whoami"
ENTRIES = f"{API}/entries"  # the listing; one entry is ENTRIES/{key}, its edit ENTRIES/{key}/edit
CONTAINS = f"{API}/contains"
LOOKUP = f"{API}/lookup"

H_META = "X-Kvc-Meta"  # an entry's JSON metadata (user metadata + a sealing client's seal)
H_CRC = "X-Kvc-Crc32c"  # the payload's CRC32C, 8 hex digits: checked by whichever side receives it
H_CREATED = "X-Kvc-Created"  # the entry's creation time, seconds since the epoch
CONTENT_TYPE = "application/vnd.kvcodec.kvc"

MAX_META_HEADER = 60 << 10  # JSON metadata in one header: under http.client's 64 KiB line limit (a seal holds 64 hex per MiB of entry)
MAX_CONTAINS = 4096  # keys per /v1/contains request
