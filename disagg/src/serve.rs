//! `disagg serve`: the engine and the OpenAI-compatible gateway in one process.

use clap::Args;
use router::{AppState, GatewayConfig};

use crate::EngineArgs;

#[derive(Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Address to listen on (use 0.0.0.0 to accept connections from other hosts).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on /v1/*, /tokenize and /detokenize.
    #[arg(long, env = "DISAGG_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// The model name clients use (default: the --model argument).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Requests accepted at once (queued or running); more get 429.
    #[arg(long, default_value_t = 1024)]
    pub max_in_flight: usize,
    /// Also serve the gRPC API (disagg.v1.Inference + grpc.health.v1) on this port.
    #[arg(long)]
    pub grpc_port: Option<u16>,
    /// Export traces over OTLP/gRPC to this endpoint (e.g. http://127.0.0.1:4317).
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
    /// Largest request body, in MiB.
    #[arg(long, default_value_t = 4)]
    pub max_body_mib: usize,
    /// Keep every CPU out of deep idle states while serving (Linux PM QoS through
    /// /dev/cpu_dma_latency, root only): a token handed to an idle gateway thread is then
    /// picked up in microseconds, at the cost of power. See docs/PERF.md.
    #[arg(long)]
    pub cpu_latency_qos: bool,
}

/// The Linux PM QoS request behind `--cpu-latency-qos`.
pub const CPU_DMA_LATENCY: &str = "/dev/cpu_dma_latency";

/// Asks the kernel (PM QoS, `path` = [`CPU_DMA_LATENCY`]) to keep every CPU out of idle
/// states that take longer than `us` µs to leave, for as long as the returned file stays
/// open; with 0 an idle CPU polls instead of halting.
pub fn hold_cpu_latency(path: &str, us: i32) -> anyhow::Result<std::fs::File> {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new().write(true).open(path).map_err(|e| {
        anyhow::anyhow!(
            "--cpu-latency-qos: cannot open {path} ({e}); it needs root on Linux: run as root or drop the flag"
        )
    })?;
    f.write_all(&us.to_ne_bytes())
        .map_err(|e| anyhow::anyhow!("--cpu-latency-qos: cannot write {path} ({e}); drop the flag"))?;
    Ok(f)
}

/// The OTLP trace exporter when an endpoint is configured (call inside the runtime).
pub fn otlp(endpoint: &Option<String>, service: &str) -> anyhow::Result<Option<router::telemetry::Telemetry>> {
    let Some(ep) = endpoint.as_deref().filter(|e| !e.is_empty()) else { return Ok(None) };
    let t = router::telemetry::Telemetry::otlp(ep, service)
        .map_err(|e| anyhow::anyhow!("cannot set up OTLP export to {ep}: {e}; check --otlp-endpoint"))?;
    tracing::info!(endpoint = ep, service, "exporting traces over OTLP");
    Ok(Some(t))
}

pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env(kernels::env::LOG)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
}

pub fn run(a: ServeArgs) -> anyhow::Result<()> {
    init_logging();
    let opts = a.engine.options()?;
    if a.max_in_flight == 0 {
        anyhow::bail!("--max-in-flight must be at least 1");
    }
    // Held until the server stops.
    let _qos = a.cpu_latency_qos.then(|| hold_cpu_latency(CPU_DMA_LATENCY, 0)).transpose()?;
    let cfg = GatewayConfig {
        served_model_name: a.served_model_name.clone().unwrap_or_else(|| opts.model.clone()),
        api_key: a.api_key.clone().filter(|k| !k.is_empty()),
        max_body_bytes: a.max_body_mib.max(1) << 20,
        spin: router::spin_default(matches!(opts.device, engine::load::Device::Cuda(_))).map_err(anyhow::Error::msg)?,
        ..GatewayConfig::default()
    };
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind((a.host.as_str(), a.port)).await.map_err(|e| {
            anyhow::anyhow!("cannot listen on {}:{}: {e}; choose another --port or --host", a.host, a.port)
        })?;
        let addr = listener.local_addr()?;
        let state = AppState::new(cfg);
        if let Some(t) = otlp(&a.otlp_endpoint, "disagg")? {
            let _ = state.telemetry.set(t);
        }
        // Listen first so /health can say "loading" while the model loads.
        let server = tokio::spawn(router::serve(listener, state.clone(), shutdown_signal()));
        if let Some(port) = a.grpc_port {
            let gl = tokio::net::TcpListener::bind((a.host.as_str(), port)).await.map_err(|e| {
                anyhow::anyhow!("cannot listen on {}:{port} for gRPC: {e}; choose another --grpc-port", a.host)
            })?;
            println!("disagg gRPC at {}", gl.local_addr()?);
            tokio::spawn(router::grpc::serve(gl, state.clone(), shutdown_signal()));
        }
        let max_in_flight = a.max_in_flight;
        let engine = tokio::task::spawn_blocking(move || engine::load::spawn_engine(&opts, max_in_flight)).await??;
        tracing::info!(backend = %engine.backend, blocks = engine.limits.n_blocks, "engine ready");
        state.set_engine(engine);
        println!("disagg serving '{}' at http://{addr}/v1", state.cfg.served_model_name);
        server.await??;
        if let Some(t) = state.telemetry.get() {
            t.shutdown();
        }
        Ok::<_, anyhow::Error>(())
    })?;
    Ok(())
}

pub async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("SIGTERM handler");
        tokio::select! {
            _ = ctrl_c => {},
            _ = term.recv() => {},
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_latency_qos_holds_while_open_or_says_what_to_change() {
        // Where the PM QoS device is usable (Linux, root), holding 0 µs shows in what the
        // device reads back, and dropping the hold restores the value before it.
        let read = || -> Option<i32> {
            let b = std::fs::read(CPU_DMA_LATENCY).ok()?;
            Some(i32::from_ne_bytes(b.get(..4)?.try_into().ok()?))
        };
        match (read(), hold_cpu_latency(CPU_DMA_LATENCY, 0)) {
            (Some(before), Ok(held)) => {
                assert_eq!(read(), Some(0), "held at 0 µs");
                drop(held);
                assert_eq!(read(), Some(before), "released");
            }
            (_, Err(e)) => assert!(e.to_string().contains("--cpu-latency-qos"), "{e}"),
            (None, Ok(_)) => {}
        }
        let e = hold_cpu_latency("/nonexistent/cpu_dma_latency", 0).unwrap_err().to_string();
        assert!(e.contains("--cpu-latency-qos") && e.contains("drop the flag"), "{e}");
    }
}
