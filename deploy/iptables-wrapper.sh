#!/bin/sh
# iptables-wrapper: installed in the image as iptables, iptables-save, iptables-restore,
# ip6tables, ip6tables-save and ip6tables-restore. It runs the legacy (x_tables) or the
# nf_tables variant of the command it was called as, whichever the HOST uses, so flannel's
# rules sit next to kube-proxy's instead of in a second, parallel rule set. (Upstream's image
# solves the same problem with kubernetes-sigs/iptables-wrappers; this is a small
# re-implementation of the idea, not a copy.)
#
# The mode is chosen once per container and cached:
#   1. FLANNEL_IPTABLES_MODE=legacy|nft in the environment wins;
#   2. otherwise the cached choice, if any;
#   3. otherwise the chains kubelet creates to advertise its mode (KUBE-IPTABLES-HINT, or
#      KUBE-KUBELET-CANARY) in the mangle table, looked for in nf_tables first, then in legacy;
#   4. otherwise the variant holding more KUBE-/FLANNEL- rules and chains (IPv4 and IPv6);
#   5. otherwise (nothing found anywhere) nf_tables, the default of current distributions.
# Reading a legacy table can make the kernel load its module (iptable_mangle, ...) on the host;
# that happens only when nf_tables shows no kubelet hint.
#
# For tests: IPTABLES_WRAPPER_SBIN (where the real iptables-legacy*/iptables-nft* binaries
# are, default /usr/sbin) and IPTABLES_WRAPPER_CACHE (the cache file, default
# /run/iptables-wrapper-mode, inside the container's own file system, so a new container
# decides again).
set -eu

sbin=${IPTABLES_WRAPPER_SBIN:-/usr/sbin}
cache=${IPTABLES_WRAPPER_CACHE:-/run/iptables-wrapper-mode}
name=${0##*/}

case "$name" in
    iptables | iptables-save | iptables-restore | ip6tables | ip6tables-save | ip6tables-restore) ;;
    *)
        echo "iptables-wrapper: must be called as iptables[-save|-restore] or ip6tables[-save|-restore], not $name" >&2
        exit 2
        ;;
esac

valid_mode() {
    [ "$1" = legacy ] || [ "$1" = nft ]
}

# Lines of `<family>-<mode>-save [args]`, empty when the command fails (module missing, ...).
save() {
    "$sbin/$1-$2-save" ${3:+"$3"} ${4:+"$4"} 2>/dev/null || true
}

has_hint() {
    save iptables "$1" -t mangle | grep -Eq '^:(KUBE-IPTABLES-HINT|KUBE-KUBELET-CANARY) '
}

count_rules() {
    {
        save iptables "$1"
        save ip6tables "$1"
    } | grep -Ec '^(:|-A )(KUBE-|FLANNEL-)|-j (KUBE-|FLANNEL-)' || true
}

detect() {
    if has_hint nft; then
        echo nft
    elif has_hint legacy; then
        echo legacy
    else
        nft_rules=$(count_rules nft)
        legacy_rules=$(count_rules legacy)
        if [ "$legacy_rules" -gt "$nft_rules" ]; then
            echo legacy
        else
            echo nft
        fi
    fi
}

mode=${FLANNEL_IPTABLES_MODE:-}
if [ -n "$mode" ]; then
    valid_mode "$mode" || {
        echo "iptables-wrapper: FLANNEL_IPTABLES_MODE must be legacy or nft, not $mode" >&2
        exit 2
    }
else
    if [ -r "$cache" ]; then
        read -r mode <"$cache" || mode=""
    fi
    if ! valid_mode "$mode"; then
        mode=$(detect)
        # Atomic, so concurrent first calls never read a half-written cache.
        printf '%s\n' "$mode" >"$cache.$$" && mv -f "$cache.$$" "$cache" || rm -f "$cache.$$"
        echo "iptables-wrapper: using iptables-$mode (the host's rules live there)" >&2
    fi
fi

# iptables-save -> iptables-nft-save, ip6tables -> ip6tables-legacy, ...
family=${name%%-*}
exec "$sbin/$family-$mode${name#"$family"}" "$@"
