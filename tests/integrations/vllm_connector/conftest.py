"""tests/integrations/vllm_connector: the vLLM connector.

``test_vllm_connector.py`` needs vLLM and runs only in the separate vLLM venv
(``bash .ci/vllm.sh`` builds ``.venv-vllm`` and runs it); anywhere vLLM is not
installed it is not even collected, so the main suite never imports vLLM.
``test_connector_units.py`` covers the connector's pure-python parts (keys,
block alignment, chunk entries, layout probe, fingerprint) in every venv.
"""

import importlib.util

collect_ignore = []
if importlib.util.find_spec("vllm") is None:
    collect_ignore.append("test_vllm_connector.py")
