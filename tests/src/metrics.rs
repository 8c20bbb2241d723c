//! Reading a service's `/metrics` in the system tests: the text, and one family's samples.

/// The `/metrics` text of the process listening on `port` (empty if it does not answer).
pub async fn scrape(port: u16) -> String {
    let url = format!("http://127.0.0.1:{port}/metrics");
    match reqwest::get(url).await {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(_) => String::new(),
    }
}

/// The sum of the samples of `name` whose labels contain every one of `labels`.
pub fn sample(text: &str, name: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .filter(|l| labels.iter().all(|want| l.contains(want)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}
