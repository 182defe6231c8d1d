#!/usr/bin/env bash
# Installs Debian's SLURM, munge and MariaDB packages for slurm/local_cluster.sh.
# Idempotent: when every binary is already present it touches neither apt nor the network,
# so .ci/run can call it on every run. Needs root (apt-get).
set -euo pipefail

# iproute2 provides `ss`, with which local_cluster.sh finds free ports.
PACKAGES=(slurmctld slurmd slurm-client slurmdbd munge mariadb-server iproute2)
# One binary per package: present binaries mean the packages are installed and the slow
# `apt-get update` can be skipped.
BINARIES=(slurmctld slurmd sbatch slurmdbd munged mariadbd ss)

missing=0
for binary in "${BINARIES[@]}"; do
    if ! command -v "$binary" >/dev/null 2>&1 && [ ! -x "/usr/sbin/$binary" ]; then
        missing=1
    fi
done
if [ "$missing" = 0 ]; then
    echo "local SLURM packages already installed"
    exit 0
fi

if [ "$(id -u)" != 0 ]; then
    echo "install_local_cluster.sh must run as root (it calls apt-get)" >&2
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive
apt-get update
# policy-rc.d refuses service starts during the install: Debian's maintainer scripts would
# otherwise try to start munge/mariadb/slurm system-wide, which local_cluster.sh never uses
# (and which fails without systemd in a container).
policy=/usr/sbin/policy-rc.d
created_policy=0
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy"
    chmod 755 "$policy"
    created_policy=1
fi
trap 'if [ "$created_policy" = 1 ]; then rm -f "$policy"; fi' EXIT
apt-get install -y --no-install-recommends "${PACKAGES[@]}"
echo "local SLURM packages installed: ${PACKAGES[*]}"
