"""Plumbing every tier shares but no contract defines: the MQTT client, the keep-alive HTTP client,
retry and backoff, Prometheus metrics, option tables and over-the-air bundle updates."""
