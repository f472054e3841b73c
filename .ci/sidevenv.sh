# Sourced by .ci/kvpress.sh and .ci/vllm.sh: the one way a side venv (a peer's pinned torch/transformers,
# apart from the main .venv) is built. Defines V (the venv), pip (quiet install/uninstall into that venv) and side_venv.
#   side_venv DIR TAG INSTALL_FN   builds DIR from scratch unless DIR/.kvcodec-TAG-ok exists (idempotent):
#                                  a fresh venv, torch==2.13.0, then INSTALL_FN; the marker is written only
#                                  when all of it succeeded.
# Packages go in with the main venv's uv when .ci/setup installed it (issue 56: the vLLM venv took 240 s with
# pip on the 2-core box): uv resolves and downloads in parallel, byte-compiles on every core, and takes torch
# from the cache the main venv's install filled. Should uv fail, the same request goes to pip, as in .ci/setup.
pip() {
    if [ -x .venv/bin/uv ]; then
        source .ci/uvargs.sh
        uv_args "$V/bin/python"
        case $1 in
            install) shift; .venv/bin/uv pip install "${UVARGS[@]}" "$@" && return 0
                     echo "sidevenv: uv failed; installing with pip instead" >&2 ;;
            uninstall) shift; local a=(); for x in "$@"; do case $x in -y|-q) ;; *) a+=("$x") ;; esac; done
                       .venv/bin/uv pip uninstall --python "$V/bin/python" -q "${a[@]}"; return ;;
        esac
        set -- install "$@"
    fi
    "$V/bin/python" -m pip -q --disable-pip-version-check "$@"
}
side_venv() {
    V=$1
    local tag=$2 install=$3
    if [ ! -f "$V/.kvcodec-$tag-ok" ]; then
        rm -rf "$V"
        "${PYTHON:-python3}" -m venv "$V"
        echo "*" > "$V/.gitignore"   # keep the venv out of git (python<3.12 venv does not)
        [ -x .venv/bin/uv ] || pip install --upgrade pip
        pip install torch==2.13.0
        "$install"
        touch "$V/.kvcodec-$tag-ok"
    fi
}
