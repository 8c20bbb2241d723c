//! Health checks run inside the containers.

use std::time::Duration;

use anyhow::{bail, Context};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

/// `grpc.health.v1.Health/Check` for the whole server (service name "") answers SERVING, over
/// mutual TLS with the container's own certificate (`PAYOUT_TLS_*`, as the service has it),
/// accepting only a certificate of `server`'s role.
pub async fn grpc(addr: &str, server: mtls::Role, timeout: Duration) -> anyhow::Result<()> {
    let url = if addr.contains("://") {
        addr.to_string()
    } else {
        format!("https://{addr}")
    };
    let tls = mtls::TlsArgs::from_env()
        .map_err(anyhow::Error::msg)?
        .load()?;
    let check = async {
        let channel = tls
            .endpoint(&url, server)?
            .connect_timeout(timeout)
            .timeout(timeout)
            .connect()
            .await
            .with_context(|| format!("connect {url}"))?;
        let answer = HealthClient::new(channel)
            .check(HealthCheckRequest {
                service: String::new(),
            })
            .await
            .context("grpc.health.v1.Health/Check")?
            .into_inner();
        let status = ServingStatus::try_from(answer.status).unwrap_or(ServingStatus::Unknown);
        if status != ServingStatus::Serving {
            bail!("{url} answers {status:?}");
        }
        anyhow::Ok(())
    };
    tokio::time::timeout(timeout, check)
        .await
        .with_context(|| format!("{url}: no answer within {timeout:?}"))?
}

/// A plain HTTP/1.0 GET answers with status 200.
pub async fn http(addr: &str, path: &str, timeout: Duration) -> anyhow::Result<()> {
    let check = async {
        let mut stream = tokio::net::TcpStream::connect(addr)
            .await
            .with_context(|| format!("connect {addr}"))?;
        stream
            .write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
            .await?;
        let mut head = vec![0u8; 64];
        let n = stream.read(&mut head).await?;
        let line = String::from_utf8_lossy(&head[..n]);
        let status = line.split_whitespace().nth(1).unwrap_or("");
        if status != "200" {
            bail!("GET {path} on {addr} answers {:?}", line.lines().next());
        }
        anyhow::Ok(())
    };
    tokio::time::timeout(timeout, check)
        .await
        .with_context(|| format!("{addr}: no answer within {timeout:?}"))?
}
