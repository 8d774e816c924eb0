//! A VICI client over charon's unix socket: commands ([`ViciClient::request`]), streamed
//! commands that answer with events ([`ViciClient::streamed`], e.g. `list-conns`), and the
//! few commands the backend uses, each checked for `success = yes`.

use std::{path::Path, path::PathBuf, time::Duration};

use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::UnixStream,
};

use super::vici::{MAX_PACKET, Message, Packet, ViciDecodeError, ViciEncodeError};

/// How long one exchange may take.
pub const VICI_TIMEOUT: Duration = Duration::from_secs(10);

/// Errors talking to charon.
#[derive(Debug, thiserror::Error)]
pub enum ViciError {
    /// The socket could not be reached or broke off.
    #[error("VICI socket {}: {source}", path.display())]
    Io {
        /// The socket.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// No answer in time.
    #[error("VICI socket {}: no answer to {command} within {VICI_TIMEOUT:?}", path.display())]
    Timeout {
        /// The socket.
        path: PathBuf,
        /// The command.
        command: String,
    },
    /// charon does not know the command or event.
    #[error("charon does not know the VICI command or event {0}")]
    Unknown(String),
    /// The command failed (`success = no`).
    #[error("VICI {command} failed: {message}")]
    Failed {
        /// The command.
        command: String,
        /// charon's `errmsg`.
        message: String,
    },
    /// Bad data.
    #[error(transparent)]
    Decode(#[from] ViciDecodeError),
    /// A message too large to encode.
    #[error(transparent)]
    Encode(#[from] ViciEncodeError),
    /// An answer that does not fit the exchange.
    #[error("unexpected VICI packet during {command}: {packet}")]
    Unexpected {
        /// The command.
        command: String,
        /// What came.
        packet: String,
    },
}

/// A connected client.
#[derive(Debug)]
pub struct ViciClient {
    path: PathBuf,
    stream: UnixStream,
}

impl ViciClient {
    /// Connects to the socket at `path`.
    pub async fn connect(path: impl AsRef<Path>) -> Result<Self, ViciError> {
        let path = path.as_ref().to_owned();
        let stream = UnixStream::connect(&path)
            .await
            .map_err(|source| ViciError::Io {
                path: path.clone(),
                source,
            })?;
        Ok(ViciClient { path, stream })
    }

    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    async fn send(&mut self, packet: &Packet) -> Result<(), ViciError> {
        let bytes = packet.encode()?;
        let path = self.path.clone();
        self.stream
            .write_all(&bytes)
            .await
            .map_err(|source| ViciError::Io { path, source })
    }

    async fn receive(&mut self) -> Result<Packet, ViciError> {
        let mut len = [0u8; 4];
        let path = self.path.clone();
        let io = |source| ViciError::Io {
            path: path.clone(),
            source,
        };
        self.stream.read_exact(&mut len).await.map_err(io)?;
        let len = u32::from_be_bytes(len) as usize;
        if len == 0 || len > MAX_PACKET {
            return Err(ViciDecodeError(format!("packet length {len}")).into());
        }
        let mut body = vec![0u8; len];
        self.stream.read_exact(&mut body).await.map_err(io)?;
        Ok(Packet::decode(&body)?)
    }

    async fn timed<T>(
        &mut self,
        command: &str,
        f: impl AsyncFnOnce(&mut Self) -> Result<T, ViciError>,
    ) -> Result<T, ViciError> {
        let path = self.path.clone();
        match tokio::time::timeout(VICI_TIMEOUT, f(self)).await {
            Ok(r) => r,
            Err(_) => Err(ViciError::Timeout {
                path,
                command: command.to_owned(),
            }),
        }
    }

    /// Sends `command` with `message` and returns the response (not checked for success).
    pub async fn request(&mut self, command: &str, message: Message) -> Result<Message, ViciError> {
        self.timed(command, async |c| {
            c.send(&Packet::CmdRequest {
                command: command.to_owned(),
                message,
            })
            .await?;
            loop {
                match c.receive().await? {
                    Packet::CmdResponse(m) => return Ok(m),
                    Packet::CmdUnknown => return Err(ViciError::Unknown(command.to_owned())),
                    // Events of an earlier registration are not ours to handle.
                    Packet::Event { .. } => continue,
                    other => {
                        return Err(ViciError::Unexpected {
                            command: command.to_owned(),
                            packet: format!("{other:?}"),
                        });
                    }
                }
            }
        })
        .await
    }

    async fn register(&mut self, event: &str, on: bool) -> Result<(), ViciError> {
        let packet = if on {
            Packet::EventRegister(event.to_owned())
        } else {
            Packet::EventUnregister(event.to_owned())
        };
        self.send(&packet).await?;
        loop {
            match self.receive().await? {
                Packet::EventConfirm => return Ok(()),
                Packet::EventUnknown => return Err(ViciError::Unknown(event.to_owned())),
                Packet::Event { .. } => continue,
                other => {
                    return Err(ViciError::Unexpected {
                        command: event.to_owned(),
                        packet: format!("{other:?}"),
                    });
                }
            }
        }
    }

    /// A streamed command: registers for `event`, sends `command`, collects the events until
    /// the response, unregisters. Returns the events' messages and the response.
    pub async fn streamed(
        &mut self,
        command: &str,
        event: &str,
        message: Message,
    ) -> Result<(Vec<Message>, Message), ViciError> {
        self.timed(command, async |c| {
            c.register(event, true).await?;
            c.send(&Packet::CmdRequest {
                command: command.to_owned(),
                message,
            })
            .await?;
            let mut events = Vec::new();
            let response = loop {
                match c.receive().await? {
                    Packet::Event { name, message } if name == event => events.push(message),
                    Packet::Event { .. } => {}
                    Packet::CmdResponse(m) => break m,
                    Packet::CmdUnknown => return Err(ViciError::Unknown(command.to_owned())),
                    other => {
                        return Err(ViciError::Unexpected {
                            command: command.to_owned(),
                            packet: format!("{other:?}"),
                        });
                    }
                }
            };
            c.register(event, false).await?;
            Ok((events, response))
        })
        .await
    }

    /// A command whose response must say `success = yes`.
    pub async fn command(&mut self, command: &str, message: Message) -> Result<Message, ViciError> {
        let response = self.request(command, message).await?;
        check_success(command, &response)?;
        Ok(response)
    }

    /// charon's `version` answer (daemon, version, sysname, release, machine).
    pub async fn version(&mut self) -> Result<Message, ViciError> {
        self.request("version", Message::new()).await
    }

    /// `load-conn`: one connection (a message with one section named after it).
    pub async fn load_conn(&mut self, conn: Message) -> Result<(), ViciError> {
        self.command("load-conn", conn).await.map(|_| ())
    }

    /// `unload-conn name`.
    pub async fn unload_conn(&mut self, name: &str) -> Result<(), ViciError> {
        self.command("unload-conn", Message::new().kv("name", name))
            .await
            .map(|_| ())
    }

    /// `get-conns`: the names of the loaded connections.
    pub async fn get_conns(&mut self) -> Result<Vec<String>, ViciError> {
        let response = self.request("get-conns", Message::new()).await?;
        Ok(response.get_list("conns").unwrap_or_default())
    }

    /// `list-conns`: every loaded connection with its configuration, as (name, section).
    pub async fn list_conns(&mut self) -> Result<Vec<(String, Message)>, ViciError> {
        let (events, _) = self
            .streamed("list-conns", "list-conn", Message::new())
            .await?;
        Ok(named_sections(&events))
    }

    /// `list-sas`: the IKE SAs with their children, as (name, section).
    pub async fn list_sas(&mut self) -> Result<Vec<(String, Message)>, ViciError> {
        let (events, _) = self
            .streamed("list-sas", "list-sa", Message::new().kv("noblock", "yes"))
            .await?;
        Ok(named_sections(&events))
    }

    /// `load-shared`: a shared secret (`type`, `data`, `owners`, and an `id` to unload it by).
    pub async fn load_shared(&mut self, shared: Message) -> Result<(), ViciError> {
        self.command("load-shared", shared).await.map(|_| ())
    }

    /// `unload-shared id`.
    pub async fn unload_shared(&mut self, id: &str) -> Result<(), ViciError> {
        self.command("unload-shared", Message::new().kv("id", id))
            .await
            .map(|_| ())
    }

    /// `get-shared`: the ids of the loaded shared secrets.
    pub async fn get_shared(&mut self) -> Result<Vec<String>, ViciError> {
        let response = self.request("get-shared", Message::new()).await?;
        Ok(response.get_list("keys").unwrap_or_default())
    }
}

/// The sections of streamed `events` (one per connection or SA), as (name, section).
fn named_sections(events: &[Message]) -> Vec<(String, Message)> {
    let mut out = Vec::new();
    for e in events {
        for (name, value) in e.entries() {
            if let super::vici::Value::Section(m) = value {
                out.push((name.clone(), m.clone()));
            }
        }
    }
    out
}

/// `success = yes`, else [`ViciError::Failed`] with `errmsg`.
pub fn check_success(command: &str, response: &Message) -> Result<(), ViciError> {
    if response.get_str("success").as_deref() == Some("yes") {
        Ok(())
    } else {
        Err(ViciError::Failed {
            command: command.to_owned(),
            message: response
                .get_str("errmsg")
                .unwrap_or_else(|| "no error message".into()),
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests fail loudly by design
mod tests {
    use super::*;
    use tokio::net::UnixListener;

    /// A scripted charon: answers each request packet with the given packets.
    async fn fake(
        dir: &Path,
        script: Vec<(Packet, Vec<Packet>)>,
    ) -> (PathBuf, tokio::task::JoinHandle<()>) {
        let path = dir.join("vici");
        let listener = UnixListener::bind(&path).unwrap();
        let task = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            for (expect, answers) in script {
                let mut len = [0u8; 4];
                s.read_exact(&mut len).await.unwrap();
                let mut body = vec![0u8; u32::from_be_bytes(len) as usize];
                s.read_exact(&mut body).await.unwrap();
                assert_eq!(Packet::decode(&body).unwrap(), expect);
                for a in answers {
                    s.write_all(&a.encode().unwrap()).await.unwrap();
                }
            }
        });
        (path, task)
    }

    #[tokio::test]
    async fn streamed_list_conns_and_failures() {
        let dir = tempfile::tempdir().unwrap();
        let conn = Message::new().section("a", Message::new().kv("version", "IKEv2"));
        let (path, task) = fake(
            dir.path(),
            vec![
                (
                    Packet::EventRegister("list-conn".into()),
                    vec![Packet::EventConfirm],
                ),
                (
                    Packet::CmdRequest {
                        command: "list-conns".into(),
                        message: Message::new(),
                    },
                    vec![
                        Packet::Event {
                            name: "list-conn".into(),
                            message: conn,
                        },
                        Packet::CmdResponse(Message::new()),
                    ],
                ),
                (
                    Packet::EventUnregister("list-conn".into()),
                    vec![Packet::EventConfirm],
                ),
                (
                    Packet::CmdRequest {
                        command: "unload-conn".into(),
                        message: Message::new().kv("name", "b"),
                    },
                    vec![Packet::CmdResponse(
                        Message::new().kv("success", "no").kv("errmsg", "not found"),
                    )],
                ),
                (
                    Packet::CmdRequest {
                        command: "nope".into(),
                        message: Message::new(),
                    },
                    vec![Packet::CmdUnknown],
                ),
            ],
        )
        .await;
        let mut c = ViciClient::connect(&path).await.unwrap();
        let conns = c.list_conns().await.unwrap();
        assert_eq!(conns.len(), 1);
        assert_eq!(conns[0].0, "a");
        let e = c.unload_conn("b").await.unwrap_err().to_string();
        assert_eq!(e, "VICI unload-conn failed: not found");
        let e = c.request("nope", Message::new()).await.unwrap_err();
        assert!(matches!(e, ViciError::Unknown(ref c) if c == "nope"), "{e}");
        task.await.unwrap();
    }
}
