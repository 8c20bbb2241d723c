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

/// TCP state ESTABLISHED in /proc/net/tcp{,6}.
const TCP_ESTABLISHED: &str = "01";

/// This network namespace holds an ESTABLISHED TCP connection to `remote_port` on some host.
pub fn connected(remote_port: u16) -> anyhow::Result<()> {
    let mut tables = String::new();
    for file in ["/proc/net/tcp", "/proc/net/tcp6"] {
        if let Ok(text) = std::fs::read_to_string(file) {
            tables.push_str(&text);
        }
    }
    if established_to(&tables, remote_port) {
        Ok(())
    } else {
        bail!("no established TCP connection to port {remote_port}")
    }
}

/// Parses the kernel's table: `sl local_address rem_address st ...`, addresses as `HEX:PORTHEX`.
pub fn established_to(tables: &str, remote_port: u16) -> bool {
    let port = format!("{remote_port:04X}");
    tables.lines().any(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        fields.len() > 3
            && fields[2].rsplit(':').next() == Some(port.as_str())
            && fields[3] == TCP_ESTABLISHED
    })
}

#[cfg(test)]
mod tests {
    use super::established_to;

    const TABLE: &str = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0B00007F:A1B3 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1
   1: 050012AC:C35A 030012AC:1C41 01 00000000:00000000 02:000A7B1F 00000000   999        0 2 1
   2: 050012AC:C35C 030012AC:1F90 06 00000000:00000000 02:000A7B1F 00000000   999        0 3 1";

    #[test]
    fn finds_an_established_connection_to_the_port() {
        assert!(established_to(TABLE, 7233)); // 0x1C41
    }

    #[test]
    fn ignores_listening_time_wait_and_other_ports() {
        assert!(!established_to(TABLE, 8080)); // 0x1F90 is TIME_WAIT (06)
        assert!(!established_to(TABLE, 41395)); // 0xA1B3 is a local listening port
        assert!(!established_to(TABLE, 5432));
    }
}
