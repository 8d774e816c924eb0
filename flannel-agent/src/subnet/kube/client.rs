//! Connecting to the API server (`--kube-api-url`, `--kubeconfig-file`, in-cluster) and
//! finding the name of the node the agent runs on.

use std::path::Path;

use k8s_openapi::api::core::v1::Pod;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, Config};

use super::KubeError;

/// Builds the API client as upstream's `clientcmd.BuildConfigFromFlags` does: a kubeconfig
/// file when given (its server replaced by `api_url` when that is given too), else just
/// `api_url` (no credentials), else the in-cluster service account.
pub async fn build_client(
    api_url: Option<&str>,
    kubeconfig_file: Option<&Path>,
) -> Result<Client, KubeError> {
    let api_url = api_url.filter(|u| !u.is_empty());
    let url = api_url
        .map(|u| {
            u.parse::<http::Uri>()
                .map_err(|e| KubeError::Config(format!("invalid --kube-api-url {u:?}: {e}")))
        })
        .transpose()?;
    let config = match (kubeconfig_file.filter(|p| !p.as_os_str().is_empty()), url) {
        (Some(path), url) => {
            let kubeconfig = Kubeconfig::read_from(path)
                .map_err(|e| KubeError::Config(format!("{}: {e}", path.display())))?;
            let mut config =
                Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
                    .await
                    .map_err(|e| KubeError::Config(format!("{}: {e}", path.display())))?;
            if let Some(url) = url {
                config.cluster_url = url;
            }
            config
        }
        (None, Some(url)) => Config::new(url),
        (None, None) => Config::incluster().map_err(|e| KubeError::Config(e.to_string()))?,
    };
    Client::try_from(config).map_err(KubeError::Client)
}

/// Where the node name comes from (upstream reads the environment variables of the same
/// names; empty values count as unset).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeNameSource {
    /// `NODE_NAME`.
    pub node_name: Option<String>,
    /// `POD_NAME`.
    pub pod_name: Option<String>,
    /// `POD_NAMESPACE`.
    pub pod_namespace: Option<String>,
}

impl NodeNameSource {
    /// Reads `NODE_NAME`, `POD_NAME` and `POD_NAMESPACE`.
    pub fn from_env() -> Self {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        NodeNameSource {
            node_name: var("NODE_NAME"),
            pod_name: var("POD_NAME"),
            pod_namespace: var("POD_NAMESPACE"),
        }
    }
}

/// The node name: `NODE_NAME`, else `spec.nodeName` of the pod `POD_NAMESPACE/POD_NAME`
/// (one GET).
pub async fn resolve_node_name(client: &Client, src: &NodeNameSource) -> Result<String, KubeError> {
    let nonempty = |v: &Option<String>| v.clone().filter(|s| !s.is_empty());
    if let Some(name) = nonempty(&src.node_name) {
        return Ok(name);
    }
    let (Some(pod), Some(namespace)) = (nonempty(&src.pod_name), nonempty(&src.pod_namespace))
    else {
        return Err(KubeError::PodEnvMissing);
    };
    let api: Api<Pod> = Api::namespaced(client.clone(), &namespace);
    let found = api.get(&pod).await.map_err(|source| KubeError::PodLookup {
        namespace: namespace.clone(),
        pod: pod.clone(),
        source,
    })?;
    found
        .spec
        .and_then(|s| s.node_name)
        .filter(|n| !n.is_empty())
        .ok_or(KubeError::PodWithoutNode { namespace, pod })
}
