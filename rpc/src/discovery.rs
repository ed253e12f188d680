//! Discovery through etcd: workers register under a lease and keep it alive; the
//! router reads and watches the registrations.
//!
//! Key: `/disagg/workers/{role}/{grpc address}`; value: a JSON [`Registration`]. The
//! lease has a TTL of [`TTL_S`] seconds and is refreshed every second, so a worker that
//! dies disappears (a delete event) within the TTL. When etcd is unreachable a worker
//! keeps retrying and, once it answers again, registers under a new lease; the router
//! keeps the workers it knows (requests keep flowing) and, on reconnecting, re-reads
//! the whole prefix (a resync) before watching again, so missed events cannot leave it
//! inconsistent.

use std::time::Duration;

use etcd_client::{Client, EventType, GetOptions, PutOptions, WatchOptions};
use serde::{Deserialize, Serialize};

pub const PREFIX: &str = "/disagg/workers/";
pub const TTL_S: i64 = 3;

/// What a worker publishes about itself (a hint: the router still asks the worker for
/// its info and checks model and KV layout before sending it anything).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Registration {
    pub role: String,
    /// gRPC address, `http://host:port`.
    pub addr: String,
    pub model: String,
    pub kv_layout: [u32; 5],
    pub kv_blocks_total: u32,
}

impl Registration {
    pub fn key(&self) -> String {
        format!("{PREFIX}{}/{}", self.role, self.addr)
    }
}

/// What the router hears.
#[derive(Clone, Debug)]
pub enum Event {
    /// The complete current set (after every (re)connection).
    Sync(Vec<Registration>),
    Put(Registration),
    /// A registration ended (lease expired or revoked): `(role, addr)`.
    Delete(String, String),
}

fn parse_key(key: &[u8]) -> Option<(String, String)> {
    let k = std::str::from_utf8(key).ok()?.strip_prefix(PREFIX)?;
    let (role, addr) = k.split_once('/')?;
    Some((role.to_string(), addr.to_string()))
}

async fn connect(endpoint: &str) -> Result<Client, etcd_client::Error> {
    // Keepalive makes a silently dead connection fail the watch, which then resyncs.
    // etcd refuses pings more often than every 5 s (--grpc-keepalive-min-time): it
    // closes the connection ("too many pings"), so stay above that.
    let opts = etcd_client::ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(2))
        .with_keep_alive(Duration::from_secs(10), Duration::from_secs(5))
        .with_keep_alive_while_idle(true);
    Client::connect([endpoint], Some(opts)).await
}

/// Keeps `reg` registered in etcd at `endpoint` until the task is dropped.
pub async fn register_forever(endpoint: String, reg: Registration) {
    let value = serde_json::to_string(&reg).expect("serializable");
    let mut announced = false;
    loop {
        let r: Result<(), etcd_client::Error> = async {
            let mut c = connect(&endpoint).await?;
            let lease = c.lease_grant(TTL_S, None).await?.id();
            c.put(reg.key(), value.clone(), Some(PutOptions::new().with_lease(lease))).await?;
            if !announced {
                tracing::info!(key = %reg.key(), "registered in etcd");
                announced = true;
            } else {
                tracing::info!(key = %reg.key(), "registered in etcd again");
            }
            let (mut keeper, mut acks) = c.lease_keep_alive(lease).await?;
            loop {
                keeper.keep_alive().await?;
                match tokio::time::timeout(Duration::from_secs(2), acks.message()).await {
                    Ok(Ok(Some(a))) if a.ttl() > 0 => {}
                    // The lease is gone (expired while etcd was away): register anew.
                    Ok(Ok(_)) => return Ok(()),
                    Ok(Err(e)) => return Err(e),
                    Err(_) => return Ok(()),
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
        .await;
        if let Err(e) = r {
            tracing::warn!(endpoint = %endpoint, error = %e, "etcd registration lost; retrying");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Reads and watches the registrations forever, calling `on` for each event: a
/// [`Event::Sync`] after every (re)connection, then puts and deletes.
pub async fn watch_forever(endpoint: String, on: impl Fn(Event) + Send + 'static) {
    loop {
        let r: Result<(), etcd_client::Error> = async {
            let mut c = connect(&endpoint).await?;
            let got = c.get(PREFIX, Some(GetOptions::new().with_prefix())).await?;
            let rev = got.header().map(|h| h.revision()).unwrap_or(0);
            let all = got.kvs().iter().filter_map(|kv| serde_json::from_slice(kv.value()).ok()).collect();
            on(Event::Sync(all));
            let mut w = c.watch(PREFIX, Some(WatchOptions::new().with_prefix().with_start_revision(rev + 1))).await?;
            while let Some(resp) = w.message().await? {
                if resp.canceled() {
                    return Ok(());
                }
                for ev in resp.events() {
                    let Some(kv) = ev.kv() else { continue };
                    match ev.event_type() {
                        EventType::Put => match serde_json::from_slice::<Registration>(kv.value()) {
                            Ok(reg) => on(Event::Put(reg)),
                            Err(e) => tracing::warn!(error = %e, "ignoring a malformed worker registration"),
                        },
                        EventType::Delete => {
                            if let Some((role, addr)) = parse_key(kv.key()) {
                                on(Event::Delete(role, addr));
                            }
                        }
                    }
                }
            }
            Ok(())
        }
        .await;
        if let Err(e) = r {
            tracing::warn!(endpoint = %endpoint, error = %e, "etcd watch lost; keeping the known workers and retrying");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}
