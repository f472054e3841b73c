"""kvcodec as a vLLM V1 KV connector (``kvcodec.integrations.vllm.connector.KvcodecConnector``).

Importing this package imports nothing from vLLM: ``config`` and ``entries``
(keys, block alignment, model fingerprint, `.kvc` chunk entries) work in any
venv; only ``kvcodec.integrations.vllm.connector`` needs vLLM. Use it with::

    --kv-transfer-config '{"kv_connector": "KvcodecConnector",
                           "kv_connector_module_path": "kvcodec.integrations.vllm.connector",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"store_url": "/var/cache/kvc",
                                                         "preset": "lossless", "namespace": "default"}}'
"""

CONNECTOR_NAME = "KvcodecConnector"
CONNECTOR_MODULE = "kvcodec.integrations.vllm.connector"


def kv_transfer_config(store_url: str, preset: str = "lossless", namespace: str = "default", **extra):
    """The ``--kv-transfer-config`` dict for this connector (pass to ``vllm.config.KVTransferConfig(**d)``)."""
    return {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"store_url": store_url, "preset": preset, "namespace": namespace, **extra},
    }
