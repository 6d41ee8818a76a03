#!/usr/bin/env bash
# Build the CPU image with podman where no Docker engine runs: `make image` calls this.
#
#   deploy/docker/build-image.sh [TAG]     (default pergrad:<version>-cpu)
#
# The Dockerfile's base, python:3.11-slim, is pulled when a registry answers. Where none
# does (this project's CI), a stand-in is made once from Debian bookworm with debootstrap
# (Python 3.11 from Debian's mirror), under a name of its own so that it never passes for
# the real base, and the unchanged Dockerfile is built on it (`podman build --from`),
# installing the same wheel `make wheel` wrote to dist/.
set -euo pipefail
cd "$(dirname "$0")/../.."
version=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
tag=${1:-pergrad:${version}-cpu}
base=docker.io/library/python:3.11-slim
stand_in_name=localhost/pergrad-stand-in:bookworm-python3.11
export CONTAINERS_CONF=${CONTAINERS_CONF:-$PWD/deploy/docker/podman/containers.conf}

if ! command -v podman >/dev/null || ! command -v runc >/dev/null; then
    apt-get update -q
    apt-get install -y -q --no-install-recommends podman runc debootstrap \
        containernetworking-plugins >/dev/null
fi

stand_in() {
    local root
    root=$(mktemp -d)
    echo "no registry answers: $stand_in_name stands in for $base (Debian bookworm)" >&2
    debootstrap --variant=minbase --include=python3,python3-pip,ca-certificates \
        bookworm "$root" http://deb.debian.org/debian >/dev/null
    rm -f "$root"/usr/lib/python3*/EXTERNALLY-MANAGED
    ln -sf /usr/bin/python3 "$root/usr/local/bin/python"
    ln -sf /usr/bin/pip3 "$root/usr/local/bin/pip"
    # A proxy's CA that this machine trusts (PyPI through an egress proxy) is trusted there too.
    cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/" \
        2>/dev/null || true
    chroot "$root" update-ca-certificates >/dev/null
    chroot "$root" apt-get clean
    rm -rf "$root"/var/lib/apt/lists/*
    tar -C "$root" -c . | podman import --change 'CMD ["python3"]' - "$stand_in_name" >/dev/null
    rm -rf "$root"
}

from=()
if ! podman image exists "$base" && ! podman pull -q "$base" 2>/dev/null; then
    podman image exists "$stand_in_name" || stand_in
    from=(--from "$stand_in_name")
fi
make -s wheel
podman build --pull=never --format docker "${from[@]}" -f deploy/docker/Dockerfile.cpu -t "$tag" .
echo "built $tag" >&2
