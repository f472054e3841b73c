# Sourced by .ci/kvpress.sh and .ci/vllm.sh: the one way a side venv (a peer's pinned torch/transformers,
# apart from the main .venv) is built. Defines V (the venv), pip (quiet pip of that venv) and side_venv.
#   side_venv DIR TAG INSTALL_FN   builds DIR from scratch unless DIR/.kvcodec-TAG-ok exists (idempotent):
#                                  a fresh venv, pip upgraded, torch==2.13.0, then INSTALL_FN; the marker
#                                  is written only when all of it succeeded.
pip() { "$V/bin/python" -m pip -q --disable-pip-version-check "$@"; }
side_venv() {
    V=$1
    local tag=$2 install=$3
    if [ ! -f "$V/.kvcodec-$tag-ok" ]; then
        rm -rf "$V"
        "${PYTHON:-python3}" -m venv "$V"
        echo "*" > "$V/.gitignore"   # keep the venv out of git (python<3.12 venv does not)
        pip install --upgrade pip
        pip install torch==2.13.0
        "$install"
        touch "$V/.kvcodec-$tag-ok"
    fi
}
