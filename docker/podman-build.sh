#!/bin/sh
# Build the project's images with podman from a Debian base made here, for machines that reach the
# package registries (PyPI, Debian) but no container registry.
#
#   docker/podman-build.sh cpu     # ghcr.io/dflash-pipeline/dflash-pipeline-cpu:<version>
#   docker/podman-build.sh cuda    # ghcr.io/dflash-pipeline/dflash-pipeline-cuda:<version>
#   docker/podman-build.sh base    # only the base image (printed)
#
# The base: Debian bookworm (minbase) with its python3 and venv made by mmdebstrap and `podman
# import`ed, tagged by a hash of everything that goes into it (suite, packages, mirror, this script,
# the extra CA certificates), so it is made once and reused until one of them changes. The extra CA
# certificates of this machine (/usr/local/share/ca-certificates) go into it: pip inside the build
# reaches PyPI through whatever authority this machine trusts. The Dockerfiles themselves are the
# ones everybody builds with `docker build`; only their base and index build arguments change here.
#
# Environment: IMAGE_REPO (default ghcr.io/dflash-pipeline), IMAGE_TAG (default: the project's
# version), DEBIAN_MIRROR, PODMAN (default podman), TORCH_WHEELS (a folder holding the torch CPU
# wheel, default /opt/wheels when it has one; otherwise the CPU image takes torch from
# download.pytorch.org as the Dockerfile says).
set -eu

HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(dirname "$HERE")
PODMAN=${PODMAN:-podman}
SUITE=bookworm
PACKAGES=python3,python3-venv,python-is-python3,ca-certificates
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
SECURITY_MIRROR=${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
CERTS=/usr/local/share/ca-certificates
IMAGE_REPO=${IMAGE_REPO:-ghcr.io/dflash-pipeline}
IMAGE_TAG=${IMAGE_TAG:-$(sed -n 's/^version = "\(.*\)"/\1/p' "$ROOT/pyproject.toml")}
# runc: crun cannot set RLIMIT_NPROC on some hosts and rejects hybrid cgroup layouts
RUNTIME_FLAGS="--runtime runc"

base_image() {
    # remade every ISO week, so the base carries the suite's current security and point-release updates
    inputs=$( { echo "$SUITE $PACKAGES $MIRROR $SECURITY_MIRROR $(date -u +%G-W%V)"; cat "$0"
                if [ -d "$CERTS" ]; then find "$CERTS" -type f -name '*.crt' | sort | xargs -r cat; fi; } \
              | sha256sum | cut -c1-12)
    tag="localhost/dflash-base:$SUITE-$inputs"
    if ! $PODMAN image exists "$tag"; then
        echo "making $tag with mmdebstrap" >&2
        set -- --quiet --variant=minbase --include="$PACKAGES" \
            --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
            --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
            --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin'
        staged=$(mktemp -d)
        trap 'rm -rf "$staged"' EXIT
        if [ -d "$CERTS" ] && [ -n "$(find "$CERTS" -type f -name '*.crt')" ]; then
            # the certificates alone (the hashed *.crt files), never anything else left in that folder
            mkdir "$staged/ca-certificates"
            find "$CERTS" -type f -name '*.crt' -exec cp {} "$staged/ca-certificates/" \;
            set -- "$@" --customize-hook="copy-in $staged/ca-certificates /usr/local/share" \
                --customize-hook='chroot "$1" update-ca-certificates'
        fi
        mmdebstrap "$@" "$SUITE" - "deb $MIRROR $SUITE main" "deb $MIRROR $SUITE-updates main" \
            "deb $SECURITY_MIRROR $SUITE-security main" \
          | $PODMAN import --quiet \
              --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
              --change 'ENV LANG=C.UTF-8' \
              --change 'CMD ["/bin/sh"]' - "$tag" >/dev/null
    fi
    echo "$tag"
}

build() {
    flavor=$1
    base=$(base_image)
    set -- --file "$HERE/Dockerfile.$flavor" --tag "$IMAGE_REPO/dflash-pipeline-$flavor:$IMAGE_TAG" \
        --build-arg "PYTHON_IMAGE=$base" --build-arg TORCH_INDEX=https://pypi.org/simple
    if [ "$flavor" = cpu ]; then
        # the CPU wheel: pip prefers torch 2.x.y+cpu from this folder to PyPI's CUDA build of 2.x.y
        wheels=${TORCH_WHEELS:-/opt/wheels}
        if ls "$wheels"/torch-*+cpu-*.whl >/dev/null 2>&1; then
            set -- "$@" --volume "$wheels:/wheels:ro" --build-arg PIP_FIND_LINKS=/wheels
        else
            set -- "$@" --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu
        fi
    fi
    # shellcheck disable=SC2086
    $PODMAN $RUNTIME_FLAGS build --layers "$@" "$ROOT"
}

case "${1:-}" in
    base) base_image ;;
    cpu|cuda) build "$1" ;;
    *) echo "usage: $0 cpu|cuda|base" >&2; exit 2 ;;
esac
