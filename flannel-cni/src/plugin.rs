//! One plugin invocation: checks as the reference skeleton does, then ADD, DEL, CHECK, GC,
//! STATUS or VERSION.
//!
//! * ADD builds the delegate config from the network config and `subnet.env`, stores it in
//!   `<dataDir>/<containerID>` and runs the delegate's ADD; its result is printed.
//! * DEL runs the delegate's DEL with the stored config (no `subnet.env` needed) and removes
//!   the file. Nothing stored → success (DEL is idempotent); an unparsable file → success
//!   without delegating (as upstream). Unlike upstream, the file is kept when the delegate's
//!   DEL fails, so the runtime's retry can still release the address.
//! * CHECK (upstream: a no-op) runs the delegate's CHECK with the stored config plus this
//!   call's `cniVersion`, `prevResult` and `runtimeConfig`; without a stored config it
//!   succeeds, as upstream. Routes without `gw` in `prevResult` get the gateway they were
//!   installed through (see [`result::with_implied_gateways`]), so older delegates do not
//!   report a false failure.
//! * STATUS (upstream: always fine) reports code 50 while `subnet.env` is not usable, so a
//!   spec-1.1 runtime keeps the node's network "not ready" until flanneld is up.
//! * GC is accepted and does nothing, as upstream.
//!
//! `runtimeConfig` of the call replaces the delegate's `runtimeConfig` for ADD, DEL and CHECK.

use std::{
    fs,
    io::{Read, Write},
    os::unix::fs::MetadataExt,
};

use serde_json::Value;

use crate::{
    cni::{self, CniEnv, CniError, Command, code},
    config::{self, NetConf, Object},
    delegate, invoke, result, store, subnet_env,
};

/// Runs one invocation: prints the result or the CNI error on `stdout`, notes on `stderr`,
/// and returns the process exit code.
pub fn run(
    env: &CniEnv,
    stdin: &mut dyn Read,
    stdout: &mut dyn Write,
    stderr: &mut dyn Write,
) -> i32 {
    let mut version = cni::CURRENT_VERSION.to_owned();
    match dispatch(env, stdin, stderr, &mut version) {
        Ok(out) => {
            if stdout
                .write_all(&out)
                .and_then(|()| stdout.flush())
                .is_err()
            {
                return 1;
            }
            0
        }
        Err(err) => {
            let _ = writeln!(stderr, "flannel: {err}");
            let _ = stdout.write_all(&err.to_json(&version));
            let _ = stdout.flush();
            1
        }
    }
}

fn about(stderr: &mut dyn Write) {
    let _ = writeln!(
        stderr,
        "CNI Plugin flannel version {} ({}/{})",
        env!("CARGO_PKG_VERSION"),
        std::env::consts::OS,
        std::env::consts::ARCH
    );
    let _ = writeln!(
        stderr,
        "CNI protocol versions supported: {}",
        cni::SUPPORTED_VERSIONS.join(", ")
    );
}

fn dispatch(
    env: &CniEnv,
    stdin: &mut dyn Read,
    log: &mut dyn Write,
    version: &mut String,
) -> Result<Vec<u8>, CniError> {
    let command = match env.validate() {
        Ok(command) => command,
        Err(err) if err.code == code::INVALID_ENV && env.command.is_empty() => {
            about(log);
            return Ok(Vec::new());
        }
        Err(err) => return Err(err),
    };
    if command == Command::Version {
        return Ok(cni::version_info());
    }
    let mut data = Vec::new();
    stdin.read_to_end(&mut data).map_err(|e| {
        CniError::new(
            code::IO_FAILURE,
            format!("error reading from stdin: {}", cni::io_text(&e)),
        )
    })?;
    let conf_version = config::check_header(&data)?;
    cni::check_version(command, &conf_version)?;
    version.clone_from(&conf_version);

    match command {
        Command::Add => add(env, &data, log),
        Command::Del => del(env, &data, log),
        Command::Check => check(env, &data, log),
        Command::Status => status(&data),
        Command::Gc => NetConf::parse(&data)
            .map(|_| Vec::new())
            .map_err(Into::into),
        Command::Version => Ok(cni::version_info()),
    }
}

/// Fails with code 8 when `CNI_NETNS` is the namespace the plugin runs in (unless
/// `CNI_NETNS_OVERRIDE` says so). A path that cannot be inspected is left to the delegate.
fn check_netns(env: &CniEnv) -> Result<(), CniError> {
    if env.netns.is_empty() || env.netns_overridden() {
        return Ok(());
    }
    let (Ok(target), Ok(own)) = (fs::metadata(&env.netns), fs::metadata("/proc/self/ns/net"))
    else {
        return Ok(());
    };
    if (target.dev(), target.ino()) == (own.dev(), own.ino()) {
        return Err(CniError::new(
            code::INVALID_NETNS,
            "plugin's netns and netns from CNI_NETNS should not be the same",
        ));
    }
    Ok(())
}

fn with_context(mut err: CniError, context: &str) -> CniError {
    err.msg = format!("{context}: {}", err.msg);
    err
}

fn add(env: &CniEnv, data: &[u8], log: &mut dyn Write) -> Result<Vec<u8>, CniError> {
    let conf = NetConf::parse(data).map_err(|e| {
        CniError::new(
            e.code(),
            format!("failed to load flannel netconf file: {e}"),
        )
    })?;
    let subnet =
        subnet_env::load(&conf.subnet_file).map_err(subnet_env::SubnetEnvError::into_cni)?;
    conf.validate_delegate()?;
    let delegate = delegate::build(&conf, &subnet)?;
    check_netns(env)?;
    let plugin = invoke::find_in_path(&delegate.plugin, &env.path)
        .map_err(|e| with_context(e, "failed to delegate add"))?;
    let bytes = delegate.to_bytes();
    store::save(&conf.data_dir, &env.container_id, &bytes)?;
    let _ = writeln!(
        log,
        "flannel: ADD {}: delegating to {} with {}",
        env.container_id,
        plugin.display(),
        String::from_utf8_lossy(&bytes)
    );
    let out = invoke::exec(&plugin, "ADD", env, &bytes)
        .map_err(|e| e.into_cni("failed to delegate add"))?;
    let _ = log.write_all(&out.stderr);
    result::adapt(out.stdout, &conf.cni_version)
}

/// A stored delegate config, if it still parses as one: a JSON object whose `type` (the
/// plugin), `name` and `cniVersion` are strings when present.
fn parse_stored(bytes: &[u8]) -> Option<(Object, String)> {
    let Ok(Value::Object(obj)) = serde_json::from_slice::<Value>(bytes) else {
        return None;
    };
    let string_or_absent = |key: &str| obj.get(key).is_none_or(|v| v.is_string() || v.is_null());
    if !(string_or_absent("type") && string_or_absent("name") && string_or_absent("cniVersion")) {
        return None;
    }
    let plugin = obj
        .get("type")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned();
    Some((obj, plugin))
}

/// The stored object with `updates` applied, serialised with sorted top-level keys (as the
/// stored bytes are).
fn rewrite(mut obj: Object, updates: Vec<(&str, Value)>) -> Vec<u8> {
    for (key, mut value) in updates {
        value.sort_all_objects();
        obj.insert(key.to_owned(), value);
    }
    obj.sort_keys();
    Value::Object(obj).to_string().into_bytes()
}

fn del(env: &CniEnv, data: &[u8], log: &mut dyn Write) -> Result<Vec<u8>, CniError> {
    let conf = NetConf::parse(data)?;
    let Some(saved) = store::load(&conf.data_dir, &env.container_id)? else {
        let _ = writeln!(
            log,
            "flannel: DEL {}: no stored delegate config, nothing to do",
            env.container_id
        );
        return Ok(Vec::new());
    };
    let Some((obj, plugin)) = parse_stored(&saved) else {
        let _ = writeln!(
            log,
            "flannel: DEL {}: stored delegate config {} does not parse; not delegating",
            env.container_id,
            store::path(&conf.data_dir, &env.container_id).display()
        );
        return Ok(Vec::new());
    };
    let bytes = match &conf.runtime_config {
        Some(rc) => rewrite(obj, vec![("runtimeConfig", Value::Object(rc.clone()))]),
        None => saved,
    };
    check_netns(env)?;
    let plugin = invoke::find_in_path(&plugin, &env.path)
        .map_err(|e| with_context(e, "failed to delegate del"))?;
    invoke::exec(&plugin, "DEL", env, &bytes).map_err(|e| e.into_cni("failed to delegate del"))?;
    if let Err(e) = store::remove(&conf.data_dir, &env.container_id) {
        let _ = writeln!(
            log,
            "flannel: DEL {}: removing the stored delegate config: {}",
            env.container_id,
            cni::io_text(&e)
        );
    }
    Ok(Vec::new())
}

fn check(env: &CniEnv, data: &[u8], log: &mut dyn Write) -> Result<Vec<u8>, CniError> {
    let conf = NetConf::parse(data)?;
    let stored = store::load(&conf.data_dir, &env.container_id)?;
    let Some((obj, plugin)) = stored.as_deref().and_then(parse_stored) else {
        let _ = writeln!(
            log,
            "flannel: CHECK {}: no usable stored delegate config, nothing to check",
            env.container_id
        );
        return Ok(Vec::new());
    };
    let mut updates = Vec::new();
    if !conf.cni_version.is_empty() {
        updates.push(("cniVersion", Value::from(conf.cni_version.as_str())));
    }
    if let Some(prev) = &conf.prev_result {
        let mut prev = prev.clone();
        result::with_implied_gateways(&mut prev);
        updates.push(("prevResult", Value::Object(prev)));
    }
    if let Some(rc) = &conf.runtime_config {
        updates.push(("runtimeConfig", Value::Object(rc.clone())));
    }
    let bytes = rewrite(obj, updates);
    let plugin = invoke::find_in_path(&plugin, &env.path)
        .map_err(|e| with_context(e, "failed to delegate check"))?;
    invoke::exec(&plugin, "CHECK", env, &bytes)
        .map_err(|e| e.into_cni("failed to delegate check"))?;
    Ok(Vec::new())
}

fn status(data: &[u8]) -> Result<Vec<u8>, CniError> {
    let conf = NetConf::parse(data)?;
    subnet_env::load(&conf.subnet_file).map_err(|e| {
        let err = e.into_cni();
        CniError::new(code::PLUGIN_NOT_AVAILABLE, err.msg)
    })?;
    Ok(Vec::new())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::{fs, os::unix::fs::PermissionsExt, path::PathBuf};

    use serde_json::json;

    use super::*;
    use crate::testutil::script;

    const SUBNET_ENV: &str = "FLANNEL_NETWORK=10.1.0.0/16\nFLANNEL_SUBNET=10.1.17.1/24\nFLANNEL_MTU=1472\nFLANNEL_IPMASQ=true\n";

    /// A temp dir with subnet.env, a data dir and a fake `bridge` that logs its command,
    /// container ID and stdin to `calls` and prints a 1.0.0 result.
    struct Fixture {
        dir: tempfile::TempDir,
    }

    impl Fixture {
        fn new() -> Self {
            let dir = tempfile::tempdir().unwrap();
            fs::write(dir.path().join("subnet.env"), SUBNET_ENV).unwrap();
            let bin = dir.path().join("bin");
            fs::create_dir(&bin).unwrap();
            let calls = dir.path().join("calls");
            script(
                &bin,
                "bridge",
                &format!(
                    r#"{{ printf '%s %s ' "$CNI_COMMAND" "$CNI_CONTAINERID"; cat; echo; }} >> {calls}
if [ "$CNI_COMMAND" = ADD ]; then
  echo '{{"cniVersion":"1.0.0","ips":[{{"address":"10.1.17.2/24","gateway":"10.1.17.1"}}]}}'
fi
if [ -e {fail} ]; then echo '{{"code":11,"msg":"delegate busy"}}'; exit 1; fi
exit 0"#,
                    calls = calls.display(),
                    fail = dir.path().join("fail").display()
                ),
            );
            Fixture { dir }
        }

        fn path(&self, name: &str) -> PathBuf {
            self.dir.path().join(name)
        }

        fn config(&self, extra: Value) -> Vec<u8> {
            let mut conf = json!({
                "cniVersion": "1.0.0",
                "name": "cbr0",
                "type": "flannel",
                "subnetFile": self.path("subnet.env"),
                "dataDir": self.path("data"),
            });
            if let (Value::Object(c), Value::Object(e)) = (&mut conf, extra) {
                c.extend(e);
            }
            conf.to_string().into_bytes()
        }

        fn env(&self, command: &str, id: &str) -> CniEnv {
            CniEnv {
                command: command.into(),
                container_id: id.into(),
                netns: "/nonexistent/netns".into(),
                ifname: "eth0".into(),
                args: String::new(),
                path: self.path("bin").display().to_string(),
                netns_override: String::new(),
            }
        }

        fn calls(&self) -> String {
            fs::read_to_string(self.path("calls")).unwrap_or_default()
        }
    }

    /// Runs one invocation: (exit code, stdout, stderr).
    fn invoke(env: &CniEnv, stdin: &[u8]) -> (i32, String, String) {
        let mut out = Vec::new();
        let mut err = Vec::new();
        let rc = run(env, &mut &stdin[..], &mut out, &mut err);
        (
            rc,
            String::from_utf8(out).unwrap(),
            String::from_utf8(err).unwrap(),
        )
    }

    fn error_of(stdout: &str) -> (u64, String) {
        let v: Value = serde_json::from_str(stdout).unwrap();
        (
            v["code"].as_u64().unwrap(),
            v["msg"].as_str().unwrap().to_owned(),
        )
    }

    fn stored(f: &Fixture, id: &str) -> Option<String> {
        fs::read_to_string(f.path("data").join(id)).ok()
    }

    #[test]
    fn add_stores_and_delegates_then_del_cleans_up() {
        let f = Fixture::new();
        let conf = f.config(json!({}));
        let (rc, out, _) = invoke(&f.env("ADD", "c1"), &conf);
        assert_eq!(rc, 0, "{out}");
        let result: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(result["ips"][0]["address"], "10.1.17.2/24");
        let saved = stored(&f, "c1").unwrap();
        assert_eq!(
            saved,
            r#"{"cniVersion":"1.0.0","ipMasq":false,"ipam":{"ranges":[[{"subnet":"10.1.17.0/24"}]],"routes":[{"dst":"10.1.0.0/16"}],"type":"host-local"},"isGateway":true,"mtu":1472,"name":"cbr0","type":"bridge"}"#
        );
        assert_eq!(
            fs::metadata(f.path("data").join("c1"))
                .unwrap()
                .permissions()
                .mode()
                & 0o777,
            0o600
        );
        assert_eq!(f.calls(), format!("ADD c1 {saved}\n"));

        // DEL sends the saved bytes and removes the file; a second DEL is a no-op success.
        let (rc, out, _) = invoke(&f.env("DEL", "c1"), &conf);
        assert_eq!((rc, out.as_str()), (0, ""));
        assert_eq!(f.calls(), format!("ADD c1 {saved}\nDEL c1 {saved}\n"));
        assert!(stored(&f, "c1").is_none());
        let (rc, out, _) = invoke(&f.env("DEL", "c1"), &conf);
        assert_eq!((rc, out.as_str()), (0, ""));
        assert_eq!(
            f.calls().lines().count(),
            2,
            "no delegation without a stored file"
        );
    }

    #[test]
    fn del_does_not_need_subnet_env() {
        let f = Fixture::new();
        let conf = f.config(json!({}));
        assert_eq!(invoke(&f.env("ADD", "c1"), &conf).0, 0);
        fs::remove_file(f.path("subnet.env")).unwrap();
        let (rc, out, _) = invoke(&f.env("DEL", "c1"), &conf);
        assert_eq!((rc, out.as_str()), (0, ""));
        assert!(f.calls().contains("DEL c1 "));
    }

    #[test]
    fn del_with_unparsable_file_succeeds_without_delegating() {
        let f = Fixture::new();
        fs::create_dir(f.path("data")).unwrap();
        fs::write(f.path("data").join("c1"), "{not json").unwrap();
        let (rc, out, err) = invoke(&f.env("DEL", "c1"), &f.config(json!({})));
        assert_eq!((rc, out.as_str()), (0, ""));
        assert!(err.contains("does not parse"), "{err}");
        assert_eq!(f.calls(), "");
        assert!(stored(&f, "c1").is_some(), "upstream keeps the file");
    }

    #[test]
    fn failed_delegate_del_keeps_the_file_for_a_retry() {
        let f = Fixture::new();
        let conf = f.config(json!({}));
        assert_eq!(invoke(&f.env("ADD", "c1"), &conf).0, 0);
        fs::write(f.path("fail"), "").unwrap();
        let (rc, out, _) = invoke(&f.env("DEL", "c1"), &conf);
        assert_eq!(rc, 1);
        assert_eq!(error_of(&out), (11, "delegate busy".to_owned()));
        assert!(stored(&f, "c1").is_some());
        fs::remove_file(f.path("fail")).unwrap();
        assert_eq!(invoke(&f.env("DEL", "c1"), &conf).0, 0);
        assert!(stored(&f, "c1").is_none());
    }

    #[test]
    fn runtime_config_reaches_the_delegate_for_add_and_del() {
        let f = Fixture::new();
        let add = f.config(json!({"runtimeConfig": {"portMappings": [{"hostPort": 80}]}}));
        assert_eq!(invoke(&f.env("ADD", "c1"), &add).0, 0);
        assert!(
            stored(&f, "c1")
                .unwrap()
                .contains(r#""runtimeConfig":{"portMappings":[{"hostPort":80}]}"#)
        );
        let del = f.config(json!({"runtimeConfig": {"bandwidth": {"b": 1, "a": 2}}}));
        assert_eq!(invoke(&f.env("DEL", "c1"), &del).0, 0);
        let calls = f.calls();
        let del_line = calls.lines().nth(1).unwrap();
        assert!(
            del_line.contains(r#""runtimeConfig":{"bandwidth":{"a":2,"b":1}},"type":"bridge"}"#),
            "{del_line}"
        );
    }

    #[test]
    fn check_delegates_with_prev_result() {
        let f = Fixture::new();
        let conf = f.config(json!({}));
        // Nothing stored: success without delegating (as upstream's no-op).
        let (rc, out, _) = invoke(&f.env("CHECK", "c1"), &conf);
        assert_eq!((rc, out.as_str()), (0, ""));
        assert_eq!(f.calls(), "");

        assert_eq!(invoke(&f.env("ADD", "c1"), &conf).0, 0);
        let prev = json!({"cniVersion":"1.0.0","ips":[{"address":"10.1.17.2/24","gateway":"10.1.17.1"}],"routes":[{"dst":"10.1.0.0/16"}]});
        let check = f.config(json!({ "prevResult": prev }));
        let (rc, out, _) = invoke(&f.env("CHECK", "c1"), &check);
        assert_eq!((rc, out.as_str()), (0, ""));
        let calls = f.calls();
        let line = calls.lines().nth(1).unwrap();
        let sent: Value = serde_json::from_str(line.strip_prefix("CHECK c1 ").unwrap()).unwrap();
        let mut want = prev.clone();
        want["routes"][0]["gw"] = json!("10.1.17.1");
        assert_eq!(sent["prevResult"], want);
        assert_eq!(sent["type"], "bridge");
        assert_eq!(sent["ipam"]["ranges"], json!([[{"subnet":"10.1.17.0/24"}]]));

        fs::write(f.path("fail"), "").unwrap();
        let (rc, out, _) = invoke(&f.env("CHECK", "c1"), &check);
        assert_eq!(rc, 1);
        assert_eq!(error_of(&out).0, 11);
    }

    #[test]
    fn check_needs_a_recent_version() {
        let f = Fixture::new();
        let mut conf: Value = serde_json::from_slice(&f.config(json!({}))).unwrap();
        conf["cniVersion"] = json!("0.3.1");
        let (rc, out, _) = invoke(&f.env("CHECK", "c1"), conf.to_string().as_bytes());
        assert_eq!(rc, 1);
        assert_eq!(
            error_of(&out),
            (1, "config version does not allow CHECK".into())
        );
    }

    #[test]
    fn missing_subnet_env_is_try_again_later() {
        let f = Fixture::new();
        fs::remove_file(f.path("subnet.env")).unwrap();
        let (rc, out, _) = invoke(&f.env("ADD", "c1"), &f.config(json!({})));
        assert_eq!(rc, 1);
        let v: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["cniVersion"], "1.0.0");
        assert_eq!(
            error_of(&out),
            (
                11,
                format!(
                    "failed to load flannel 'subnet.env' file: open {}: no such file or directory. Check the flannel pod log for this node.",
                    f.path("subnet.env").display()
                )
            )
        );
        assert!(stored(&f, "c1").is_none());
        assert_eq!(f.calls(), "");
    }

    #[test]
    fn status_reports_whether_flannel_is_up() {
        let f = Fixture::new();
        let mut conf: Value = serde_json::from_slice(&f.config(json!({}))).unwrap();
        conf["cniVersion"] = json!("1.1.0");
        let conf = conf.to_string().into_bytes();
        let env = CniEnv {
            command: "STATUS".into(),
            path: "/x".into(),
            ..CniEnv::default()
        };
        assert_eq!(invoke(&env, &conf), (0, String::new(), String::new()));
        fs::remove_file(f.path("subnet.env")).unwrap();
        let (rc, out, _) = invoke(&env, &conf);
        assert_eq!(rc, 1);
        let (code, msg) = error_of(&out);
        assert_eq!(code, 50);
        assert!(msg.contains("no such file or directory"), "{msg}");
    }

    #[test]
    fn gc_is_accepted() {
        let f = Fixture::new();
        let mut conf: Value = serde_json::from_slice(&f.config(json!({}))).unwrap();
        conf["cniVersion"] = json!("1.1.0");
        let env = CniEnv {
            command: "GC".into(),
            path: "/x".into(),
            ..CniEnv::default()
        };
        assert_eq!(invoke(&env, conf.to_string().as_bytes()).0, 0);
    }

    #[test]
    fn decoding_and_config_errors() {
        let f = Fixture::new();
        let env = f.env("ADD", "c1");
        let (rc, out, _) = invoke(&env, b"{\"name\": ");
        assert_eq!(rc, 1);
        let (code, msg) = error_of(&out);
        assert_eq!(code, 6);
        assert!(
            msg.starts_with("error unmarshall network config: "),
            "{msg}"
        );
        // The error is reported in the spec's newest version when the config's is unknown.
        let v: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["cniVersion"], "1.1.0");

        let (_, out, _) = invoke(&env, &f.config(json!({"dataDir": 5})));
        let (code, msg) = error_of(&out);
        assert_eq!(code, 6);
        assert!(
            msg.starts_with("failed to load flannel netconf file: failed to load netconf: "),
            "{msg}"
        );

        let (_, out, _) = invoke(&env, &f.config(json!({"delegate": {"name": "x"}})));
        assert_eq!(
            error_of(&out),
            (
                7,
                "'delegate' dictionary must not have 'name' field, it'll be set by flannel".into()
            )
        );
        let (_, out, _) = invoke(&env, &f.config(json!({"cniVersion": "7.0.0"})));
        assert_eq!(error_of(&out), (1, "incompatible CNI versions".into()));
        assert_eq!(f.calls(), "");
    }

    #[test]
    fn missing_delegate_names_plugin_and_path() {
        let f = Fixture::new();
        let (rc, out, _) = invoke(
            &f.env("ADD", "c1"),
            &f.config(json!({"delegate": {"type": "ipvlan"}})),
        );
        assert_eq!(rc, 1);
        let v: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["code"], 101);
        assert_eq!(
            v["msg"],
            format!(
                "failed to delegate add: failed to find plugin \"ipvlan\" in path [{}]",
                f.path("bin").display()
            )
        );
        assert!(
            stored(&f, "c1").is_none(),
            "nothing stored when nothing can run"
        );
    }

    #[test]
    fn own_netns_is_rejected() {
        let f = Fixture::new();
        let mut env = f.env("ADD", "c1");
        env.netns = "/proc/self/ns/net".into();
        let (rc, out, _) = invoke(&env, &f.config(json!({})));
        assert_eq!(rc, 1);
        assert_eq!(error_of(&out).0, 8);
        env.netns_override = "true".into();
        assert_eq!(invoke(&env, &f.config(json!({}))).0, 0);
    }

    #[test]
    fn version_and_about() {
        let env = CniEnv {
            command: "VERSION".into(),
            ..CniEnv::default()
        };
        let (rc, out, _) = invoke(&env, b"");
        assert_eq!(rc, 0);
        assert_eq!(out.as_bytes(), cni::version_info());
        let (rc, out, err) = invoke(&CniEnv::default(), b"");
        assert_eq!((rc, out.as_str()), (0, ""));
        assert!(err.starts_with("CNI Plugin flannel version "), "{err}");
        assert!(err.contains(
            "CNI protocol versions supported: 0.1.0, 0.2.0, 0.3.0, 0.3.1, 0.4.0, 1.0.0, 1.1.0"
        ));
        let env = CniEnv {
            command: "ADD".into(),
            ..CniEnv::default()
        };
        let (rc, out, _) = invoke(&env, b"");
        assert_eq!(rc, 1);
        assert_eq!(error_of(&out).0, 4);
    }

    #[test]
    fn result_is_converted_when_the_delegate_answers_in_another_version() {
        let f = Fixture::new();
        let mut conf: Value = serde_json::from_slice(&f.config(json!({}))).unwrap();
        conf["cniVersion"] = json!("0.4.0");
        let (rc, out, _) = invoke(&f.env("ADD", "c1"), conf.to_string().as_bytes());
        assert_eq!(rc, 0, "{out}");
        let v: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["cniVersion"], "0.4.0");
        assert_eq!(v["ips"][0]["version"], "4");
    }
}
