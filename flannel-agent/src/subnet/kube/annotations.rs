//! The Node annotation names flannel reads and writes, derived from `--kube-annotation-prefix`.

use std::sync::LazyLock;

use regex::Regex;

use super::KubeError;

/// The default `--kube-annotation-prefix`.
pub const DEFAULT_PREFIX: &str = "flannel.alpha.coreos.com";

/// Upstream's check of the normalised prefix. Like upstream (Go `regexp.MatchString`) it is
/// anchored at the end only.
static PREFIX_RE: LazyLock<Option<Regex>> =
    LazyLock::new(|| Regex::new(r"(?:[a-z0-9_-]+\.)+[a-z0-9_-]+/(?:[a-z0-9_-]+-)?$").ok());

/// The full annotation keys for one prefix (upstream `annotations`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AnnotationKeys {
    /// The normalised prefix: ends in `/` or `-` (`flannel.alpha.coreos.com/`).
    pub prefix: String,
    /// `kube-subnet-manager`: `"true"` marks a node managed by flannel.
    pub subnet_kube_managed: String,
    /// `backend-data`: the IPv4 BackendData JSON text.
    pub backend_data: String,
    /// `backend-v6-data`: the IPv6 BackendData JSON text.
    pub backend_v6_data: String,
    /// `backend-type`.
    pub backend_type: String,
    /// `public-ip`: the node's advertised IPv4 address.
    pub public_ip: String,
    /// `public-ipv6`: the node's advertised IPv6 address.
    pub public_ipv6: String,
    /// `node-public-ip` (set by the user): used as `--public-ip` at startup.
    pub node_public_ip: String,
    /// `node-public-ipv6` (set by the user): used as `--public-ipv6` at startup.
    pub node_public_ipv6: String,
    /// `public-ip-overwrite` (set by the user): published instead of the detected address.
    pub public_ip_overwrite: String,
    /// `public-ipv6-overwrite` (set by the user): the same for IPv6.
    pub public_ipv6_overwrite: String,
}

impl AnnotationKeys {
    /// Normalises and validates `prefix` as upstream does: at most one `/`; no slash → append
    /// `/`; then, unless it ends in `/` or `-`, append `-`; the result must look like
    /// `fqdn/[0-9a-z-_]*`.
    pub fn new(prefix: &str) -> Result<Self, KubeError> {
        let slashes = prefix.matches('/').count();
        if slashes > 1 {
            return Err(KubeError::PrefixSlashes);
        }
        let mut p = prefix.to_owned();
        if slashes == 0 {
            p.push('/');
        }
        if !p.ends_with('/') && !p.ends_with('-') {
            p.push('-');
        }
        let valid = PREFIX_RE.as_ref().is_some_and(|re| re.is_match(&p));
        if !valid {
            return Err(KubeError::PrefixFormat);
        }
        let key = |name: &str| format!("{p}{name}");
        Ok(AnnotationKeys {
            subnet_kube_managed: key("kube-subnet-manager"),
            backend_data: key("backend-data"),
            backend_v6_data: key("backend-v6-data"),
            backend_type: key("backend-type"),
            public_ip: key("public-ip"),
            public_ipv6: key("public-ipv6"),
            node_public_ip: key("node-public-ip"),
            node_public_ipv6: key("node-public-ipv6"),
            public_ip_overwrite: key("public-ip-overwrite"),
            public_ipv6_overwrite: key("public-ipv6-overwrite"),
            prefix: p,
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests fail loudly by design
mod tests {
    use super::*;

    #[test]
    fn prefix_vectors() {
        let ok = [
            (
                "flannel.alpha.coreos.com",
                "flannel.alpha.coreos.com/backend-type",
            ),
            (
                "flannel.alpha.coreos.com/",
                "flannel.alpha.coreos.com/backend-type",
            ),
            (
                "flannel.alpha.coreos.com/prefix",
                "flannel.alpha.coreos.com/prefix-backend-type",
            ),
            (
                "flannel.alpha.coreos.com/prefix-",
                "flannel.alpha.coreos.com/prefix-backend-type",
            ),
            ("org.com", "org.com/backend-type"),
            ("org9.com", "org9.com/backend-type"),
            ("org.com/9", "org.com/9-backend-type"),
        ];
        for (prefix, want) in ok {
            assert_eq!(
                AnnotationKeys::new(prefix).unwrap().backend_type,
                want,
                "{prefix}"
            );
        }
        for bad in ["org", "org/", "org/prefix", "org.COM", "org.com/PREFIX"] {
            assert_eq!(
                AnnotationKeys::new(bad).unwrap_err().to_string(),
                "subnet/kube: prefix must be in a format: fqdn/[0-9a-z-_]*",
                "{bad}"
            );
        }
        assert_eq!(
            AnnotationKeys::new("a.b/c/d").unwrap_err().to_string(),
            "subnet/kube: prefix can contain at most single slash"
        );
    }

    #[test]
    fn all_keys_share_the_prefix() {
        let k = AnnotationKeys::new(DEFAULT_PREFIX).unwrap();
        assert_eq!(k.prefix, "flannel.alpha.coreos.com/");
        assert_eq!(
            k.subnet_kube_managed,
            "flannel.alpha.coreos.com/kube-subnet-manager"
        );
        assert_eq!(k.backend_data, "flannel.alpha.coreos.com/backend-data");
        assert_eq!(
            k.backend_v6_data,
            "flannel.alpha.coreos.com/backend-v6-data"
        );
        assert_eq!(k.public_ip, "flannel.alpha.coreos.com/public-ip");
        assert_eq!(k.public_ipv6, "flannel.alpha.coreos.com/public-ipv6");
        assert_eq!(k.node_public_ip, "flannel.alpha.coreos.com/node-public-ip");
        assert_eq!(
            k.node_public_ipv6,
            "flannel.alpha.coreos.com/node-public-ipv6"
        );
        assert_eq!(
            k.public_ip_overwrite,
            "flannel.alpha.coreos.com/public-ip-overwrite"
        );
        assert_eq!(
            k.public_ipv6_overwrite,
            "flannel.alpha.coreos.com/public-ipv6-overwrite"
        );
        // Unanchored at the start, like upstream: only the tail must look like fqdn/.
        assert!(AnnotationKeys::new("Org.com").is_ok());
    }
}
