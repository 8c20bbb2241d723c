#!/usr/bin/env python3
"""Screenshots of Temporal UI pages with headless Chromium, driven over the DevTools protocol.

Usage: ui_screenshot.py CHROMIUM OUT.png URL TEXT [URL TEXT ...] -- one OUT per URL, in order:
  ui_screenshot.py chromium a.png URL_A 'text A' b.png URL_B 'text B'

Each page is loaded and the script waits (at most RENDER_WAIT_S) until its visible text contains
TEXT, then a little longer for the last requests to paint (SETTLE_S). Chromium's own
`--screenshot --virtual-time-budget` never returns on the workflow page: its history long-poll
keeps a request open, so virtual time never runs out. Standard library only (a minimal WebSocket
client), so the script needs nothing beyond Python and Chromium.
"""

import base64
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

# The UI renders a page in about a second here; a slow machine gets this long before we give up.
RENDER_WAIT_S = 60
# After the awaited text appears: the rest of the page's requests (event history, metadata).
SETTLE_S = 3
# Chromium's DevTools endpoint comes up within a second or two.
DEVTOOLS_WAIT_S = 30
WINDOW = (1600, 1200)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cdp:
    """One DevTools WebSocket: send a command, read frames until its answer."""

    def __init__(self, ws_url):
        host_port, path = ws_url[len("ws://"):].split("/", 1)
        host, port = host_port.split(":")
        self.sock = socket.create_connection((host, int(port)), timeout=RENDER_WAIT_S)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall(
            (
                f"GET /{path} HTTP/1.1\r\nHost: {host_port}\r\nUpgrade: websocket\r\n"
                f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                "Sec-WebSocket-Version: 13\r\n\r\n"
            ).encode()
        )
        response = b""
        while b"\r\n\r\n" not in response:
            chunk = self.sock.recv(4096)
            if not chunk:
                raise RuntimeError("DevTools closed the connection during the handshake")
            response += chunk
        if b" 101 " not in response.split(b"\r\n", 1)[0]:
            raise RuntimeError(f"DevTools refused the WebSocket: {response[:200]!r}")
        self.buffer = response.split(b"\r\n\r\n", 1)[1]
        self.next_id = 0

    def _read(self, n):
        while len(self.buffer) < n:
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise RuntimeError("DevTools closed the connection")
            self.buffer += chunk
        data, self.buffer = self.buffer[:n], self.buffer[n:]
        return data

    def _frame(self):
        message = b""
        while True:
            head = self._read(2)
            fin, opcode, length = head[0] & 0x80, head[0] & 0x0F, head[1] & 0x7F
            if length == 126:
                length = int.from_bytes(self._read(2), "big")
            elif length == 127:
                length = int.from_bytes(self._read(8), "big")
            payload = self._read(length)
            if opcode == 0x8:
                raise RuntimeError("DevTools closed the WebSocket")
            if opcode in (0x0, 0x1, 0x2):
                message += payload
                if fin:
                    return message

    def call(self, method, **params):
        self.next_id += 1
        data = json.dumps({"id": self.next_id, "method": method, "params": params}).encode()
        mask = os.urandom(4)
        length = len(data)
        if length < 126:
            head = bytes([0x81, 0x80 | length])
        elif length < 1 << 16:
            head = bytes([0x81, 0x80 | 126]) + length.to_bytes(2, "big")
        else:
            head = bytes([0x81, 0x80 | 127]) + length.to_bytes(8, "big")
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(data))
        self.sock.sendall(head + mask + masked)
        while True:
            answer = json.loads(self._frame())
            if answer.get("id") == self.next_id:
                if "error" in answer:
                    raise RuntimeError(f"{method}: {answer['error']}")
                return answer.get("result", {})


def page_text(cdp):
    result = cdp.call(
        "Runtime.evaluate", expression="document.body ? document.body.innerText : ''"
    )
    return result.get("result", {}).get("value", "")


def shoot(cdp, out, url, text):
    cdp.call("Page.navigate", url=url)
    deadline = time.monotonic() + RENDER_WAIT_S
    while text not in (shown := page_text(cdp)):
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{url}: {text!r} not shown within {RENDER_WAIT_S} s; the page shows:\n{shown[:2000]}"
            )
        time.sleep(0.5)
    time.sleep(SETTLE_S)
    shot = cdp.call("Page.captureScreenshot", format="png", captureBeyondViewport=False)
    with open(out, "wb") as f:
        f.write(base64.b64decode(shot["data"]))
    print(f"{out}: {url}")


def main(argv):
    if len(argv) < 5 or (len(argv) - 2) % 3 != 0:
        sys.exit(__doc__)
    chromium, shots = argv[1], argv[2:]
    port = free_port()
    profile = tempfile.mkdtemp(prefix="ui-screenshots-")
    browser = subprocess.Popen(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            f"--window-size={WINDOW[0]},{WINDOW[1]}",
            f"--remote-debugging-port={port}",
            f"--user-data-dir={profile}",
            "about:blank",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + DEVTOOLS_WAIT_S
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list") as r:
                    pages = [t for t in json.load(r) if t.get("type") == "page"]
                if pages:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"Chromium's DevTools did not come up within {DEVTOOLS_WAIT_S} s")
            time.sleep(0.2)
        cdp = Cdp(pages[0]["webSocketDebuggerUrl"])
        cdp.call("Page.enable")
        # The UI sits behind the Temporal front's login (UI_LOGIN=user:password) and its TLS,
        # whose certificate is the local stack's own authority's, which Chromium does not know:
        # the login goes with every request, and the certificate check is waived for this
        # throwaway headless profile only.
        login = os.environ.get("UI_LOGIN")
        if login:
            token = base64.b64encode(login.encode()).decode()
            cdp.call("Network.enable")
            cdp.call("Network.setExtraHTTPHeaders", headers={"Authorization": f"Basic {token}"})
            cdp.call("Security.setIgnoreCertificateErrors", ignore=True)
        for i in range(0, len(shots), 3):
            shoot(cdp, shots[i], shots[i + 1], shots[i + 2])
    finally:
        browser.terminate()
        try:
            browser.wait(timeout=10)
        except subprocess.TimeoutExpired:
            browser.kill()
        shutil.rmtree(profile, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv)
