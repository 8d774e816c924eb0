#!/bin/sh
# install-cni SOURCE DESTINATION [SOURCE DESTINATION ...]
#
# Installs each SOURCE as DESTINATION atomically, for the DaemonSet's init container: the CNI
# plugin binary into /opt/cni/bin and the network list into /etc/cni/net.d. Readers (a kubelet
# executing the plugin, a container runtime loading the conflist) see either the old file or
# the complete new one, never a partial copy:
#
#   1. copy SOURCE to a temporary ".<name>.tmpXXXXXX" file in DESTINATION's directory (same
#      file system, and a name no runtime loads: it starts with a dot and has no .conf,
#      .conflist or .json extension);
#   2. flush it to disk, give it SOURCE's permission bits;
#   3. rename it over DESTINATION (rename(2) replaces the name in one step, and a running
#      process keeps the old inode, so there is no "text file busy");
#   4. flush the directory.
#
# Installed as /opt/bin/install-cni and also as /opt/bin/install-conf, so upstream manifests
# that call `install-conf SOURCE DESTINATION` work with this image.
set -eu

prog=${0##*/}

die() {
    echo "$prog: $*" >&2
    exit 1
}

tmp=""
cleanup() {
    if [ -n "$tmp" ]; then
        rm -f -- "$tmp"
    fi
}
trap cleanup EXIT
trap 'exit 129' HUP
trap 'exit 130' INT
trap 'exit 143' TERM

install_one() {
    src=$1
    dst=$2
    [ -f "$src" ] || die "source $src is not a file"
    dir=$(dirname -- "$dst")
    base=$(basename -- "$dst")
    [ -d "$dir" ] || die "destination directory $dir does not exist"
    [ ! -d "$dst" ] || die "destination $dst is a directory"
    # Leftovers of an install that was killed half way.
    rm -f -- "$dir/.$base.tmp"*
    tmp=$(mktemp -- "$dir/.$base.tmpXXXXXX") || die "cannot create a temporary file in $dir"
    cat -- "$src" >"$tmp" || die "cannot copy $src to $tmp"
    chmod --reference="$src" -- "$tmp" || die "cannot set the mode of $tmp"
    sync -- "$tmp" || die "cannot flush $tmp"
    mv -f -T -- "$tmp" "$dst" || die "cannot rename $tmp to $dst"
    tmp=""
    # Persist the new directory entry; some file systems refuse fsync on a directory.
    sync -- "$dir" 2>/dev/null || true
    echo "$prog: installed $src as $dst"
}

if [ $# -eq 0 ] || [ $(($# % 2)) -ne 0 ]; then
    echo "usage: $prog SOURCE DESTINATION [SOURCE DESTINATION ...]" >&2
    exit 2
fi

while [ $# -gt 0 ]; do
    install_one "$1" "$2"
    shift 2
done
