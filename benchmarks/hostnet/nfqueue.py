"""The impairment process: every packet arriving at a host held a fixed time, or dropped at random, in user space
(NFQUEUE over raw netlink).

This kernel has no ``netem``: see ``network_patterns.py``'s docstring for why and how. ``iptables`` steers a host's
arriving packets to queue 0 (``network.Network.impair``); this process holds each one ``delay`` from its arrival
and then accepts it, in arrival order, by batch verdicts, and drops each with probability ``loss`` at once (a verdict
of its own) instead. In C (:data:`PROGRAM_C`, compiled where a C compiler is), else in Python (``python -m
hostnet.nfqueue DELAY_S LOSS``).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import random
import select
import shutil
import socket
import struct
import sys
import time

from hostnet.processes import PR_SET_TIMERSLACK, die_with_parent, run

NETLINK_NETFILTER, NFNL_SUBSYS_QUEUE = 12, 3
NFQNL_MSG_PACKET, NFQNL_MSG_VERDICT, NFQNL_MSG_CONFIG, NFQNL_MSG_VERDICT_BATCH = 0, 1, 2, 3
NLM_F_REQUEST, NLM_F_ACK, NLMSG_ERROR = 1, 4, 2
SO_RCVBUFFORCE, SOL_NETLINK, NETLINK_NO_ENOBUFS = 33, 270, 5
NF_DROP, NF_ACCEPT = 0, 1


def _nlattr(kind: int, payload: bytes) -> bytes:
    length = 4 + len(payload)
    return struct.pack("=HH", length, kind) + payload + b"\0" * (-length % 4)


def _nfq_message(msg_type: int, attrs: list[bytes], seq: int, flags: int = NLM_F_REQUEST) -> bytes:
    body = struct.pack("=BBH", socket.AF_UNSPEC, 0, socket.htons(0)) + b"".join(attrs)  # queue 0
    return struct.pack("=IHHII", 16 + len(body), (NFNL_SUBSYS_QUEUE << 8) | msg_type, flags, seq, 0) + body


#: The same process in C, compiled when a C compiler is at hand: it costs the packets' path a tenth of the CPU time.
#: Arguments: the delay in nanoseconds, the loss in parts per million.
PROGRAM_C = r"""
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <linux/netfilter.h>
#include <linux/netfilter/nfnetlink.h>
#include <linux/netfilter/nfnetlink_queue.h>
#include <linux/netlink.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define SLOTS (1 << 20)
static int64_t due[SLOTS];
static uint32_t ids[SLOTS];

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static size_t put_attr(char *at, uint16_t type, const void *data, uint16_t len) {
    struct nlattr *a = (struct nlattr *)at;
    a->nla_len = NLA_HDRLEN + len;
    a->nla_type = type;
    memcpy(at + NLA_HDRLEN, data, len);
    return NLA_ALIGN(a->nla_len);
}

static size_t message(char *buf, uint16_t type, uint16_t flags, uint32_t seq) {
    struct nlmsghdr *h = (struct nlmsghdr *)buf;
    memset(buf, 0, NLMSG_HDRLEN + sizeof(struct nfgenmsg));
    h->nlmsg_type = (NFNL_SUBSYS_QUEUE << 8) | type;
    h->nlmsg_flags = flags;
    h->nlmsg_seq = seq;
    struct nfgenmsg *g = (struct nfgenmsg *)(buf + NLMSG_HDRLEN);
    g->nfgen_family = AF_UNSPEC;
    g->version = NFNETLINK_V0;
    g->res_id = htons(0);
    return NLMSG_HDRLEN + NLMSG_ALIGN(sizeof(struct nfgenmsg));
}

static void configure(int fd, uint32_t seq, const char *attrs, size_t len) {
    char buf[256], reply[4096];
    size_t n = message(buf, NFQNL_MSG_CONFIG, NLM_F_REQUEST | NLM_F_ACK, seq);
    memcpy(buf + n, attrs, len);
    ((struct nlmsghdr *)buf)->nlmsg_len = n + len;
    if (send(fd, buf, n + len, 0) < 0) { perror("send"); exit(1); }
    ssize_t got = recv(fd, reply, sizeof reply, 0);
    struct nlmsghdr *h = (struct nlmsghdr *)reply;
    if (got >= (ssize_t)(NLMSG_HDRLEN + sizeof(int)) && h->nlmsg_type == NLMSG_ERROR) {
        int error = ((struct nlmsgerr *)NLMSG_DATA(h))->error;
        if (error) { fprintf(stderr, "NFQUEUE configuration step %u: %s\n", seq, strerror(-error)); exit(1); }
    }
}

int main(int argc, char **argv) {
    if (argc != 3) return 2;
    int64_t delay = atoll(argv[1]);
    long loss = atol(argv[2]);  /* parts per million */
    srandom((unsigned)now_ns());
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    int fd = socket(AF_NETLINK, SOCK_RAW, NETLINK_NETFILTER);
    if (fd < 0) { perror("socket"); return 1; }
    int size = 16 << 20, one = 1;
    setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &size, sizeof size);
    setsockopt(fd, SOL_NETLINK, NETLINK_NO_ENOBUFS, &one, sizeof one);
    struct sockaddr_nl local = {.nl_family = AF_NETLINK};
    if (bind(fd, (struct sockaddr *)&local, sizeof local) < 0) { perror("bind"); return 1; }
    char attrs[64];
    struct nfqnl_msg_config_cmd cmd = {.command = NFQNL_CFG_CMD_BIND};
    configure(fd, 1, attrs, put_attr(attrs, NFQA_CFG_CMD, &cmd, sizeof cmd));
    struct nfqnl_msg_config_params params = {.copy_range = htonl(0), .copy_mode = NFQNL_COPY_META};
    configure(fd, 2, attrs, put_attr(attrs, NFQA_CFG_PARAMS, &params, sizeof params));
    uint32_t maxlen = htonl(1 << 17), gso = htonl(NFQA_CFG_F_GSO);
    configure(fd, 3, attrs, put_attr(attrs, NFQA_CFG_QUEUE_MAXLEN, &maxlen, sizeof maxlen));
    size_t n = put_attr(attrs, NFQA_CFG_MASK, &gso, sizeof gso);
    n += put_attr(attrs + n, NFQA_CFG_FLAGS, &gso, sizeof gso);
    configure(fd, 4, attrs, n);
    struct sched_param fifo = {.sched_priority = 50};
    sched_setscheduler(0, SCHED_FIFO, &fifo);
    prctl(PR_SET_TIMERSLACK, 1);
    char verdict[64];
    size_t head_len = message(verdict, NFQNL_MSG_VERDICT_BATCH, NLM_F_REQUEST, 0);
    struct nfqnl_msg_verdict_hdr vh = {.verdict = htonl(NF_ACCEPT), .id = 0};
    size_t verdict_len = head_len + put_attr(verdict + head_len, NFQA_VERDICT_HDR, &vh, sizeof vh);
    ((struct nlmsghdr *)verdict)->nlmsg_len = verdict_len;
    uint32_t *verdict_id = (uint32_t *)(verdict + head_len + NLA_HDRLEN + 4);
    char drop[64];
    size_t drop_head = message(drop, NFQNL_MSG_VERDICT, NLM_F_REQUEST, 0);
    struct nfqnl_msg_verdict_hdr dh = {.verdict = htonl(NF_DROP), .id = 0};
    size_t drop_len = drop_head + put_attr(drop + drop_head, NFQA_VERDICT_HDR, &dh, sizeof dh);
    ((struct nlmsghdr *)drop)->nlmsg_len = drop_len;
    uint32_t *drop_id = (uint32_t *)(drop + drop_head + NLA_HDRLEN + 4);
    static char buf[1 << 16];
    size_t first = 0, last = 0;  /* pending packets: [first, last) modulo SLOTS */
    struct pollfd p = {.fd = fd, .events = POLLIN};
    printf("ready\n");
    fflush(stdout);
    for (;;) {
        if (first != last) {
            int64_t left = due[first % SLOTS] - now_ns();
            if (left > 0) {
                struct timespec t = {left / 1000000000LL, left % 1000000000LL};
                ppoll(&p, 1, &t, NULL);
            }
        } else {
            ppoll(&p, 1, NULL, NULL);
        }
        for (;;) {
            ssize_t got = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
            if (got <= 0) break;
            int64_t t = now_ns() + delay;
            for (struct nlmsghdr *h = (struct nlmsghdr *)buf; NLMSG_OK(h, (size_t)got); h = NLMSG_NEXT(h, got)) {
                if (h->nlmsg_type != ((NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET)) continue;
                char *a = (char *)NLMSG_DATA(h) + NLMSG_ALIGN(sizeof(struct nfgenmsg));
                char *end = (char *)h + h->nlmsg_len;
                while (a + NLA_HDRLEN <= end) {
                    struct nlattr *attr = (struct nlattr *)a;
                    if (attr->nla_len < NLA_HDRLEN) break;
                    if ((attr->nla_type & NLA_TYPE_MASK) == NFQA_PACKET_HDR) {
                        struct nfqnl_msg_packet_hdr *ph = (struct nfqnl_msg_packet_hdr *)(a + NLA_HDRLEN);
                        if (loss && random() % 1000000 < loss) {
                            *drop_id = ph->packet_id;  /* now: a batch verdict accepts only packets still queued */
                            send(fd, drop, drop_len, 0);
                        } else if (last - first < SLOTS) {
                            due[last % SLOTS] = t;
                            ids[last % SLOTS] = ph->packet_id;  /* network order, as the verdict wants it */
                            last++;
                        }
                        break;
                    }
                    a += NLA_ALIGN(attr->nla_len);
                }
            }
        }
        int64_t now = now_ns();
        int release = 0;
        while (first != last && due[first % SLOTS] <= now) {
            *verdict_id = ids[first % SLOTS];
            first++;
            release = 1;
        }
        if (release) send(fd, verdict, verdict_len, 0);
    }
}
"""


def compile_program(folder: str) -> str | None:
    """The C process, built in ``folder``; None without a compiler (the Python one runs instead)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    source, binary = os.path.join(folder, "nfqueue.c"), os.path.join(folder, "nfqueue")
    with open(source, "w") as out:
        out.write(PROGRAM_C)
    built = run(compiler, "-O2", "-o", binary, source, check=False)
    return binary if built.returncode == 0 else None


def command(program: str | None, delay: float, loss: float) -> list[str]:
    """The command line of the process for ``delay`` seconds and a ``loss`` fraction: the C ``program``, else Python's."""
    if program is not None:
        return [program, str(int(delay * 1e9)), str(int(loss * 1e6))]
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return ["env", f"PYTHONPATH={here}", sys.executable, "-m", "hostnet.nfqueue", repr(delay), repr(loss)]


def main(delay: float, loss: float) -> None:
    """Holds every packet of NFQUEUE 0 for ``delay`` seconds from its arrival, then accepts it (FIFO); drops each
    with probability ``loss`` instead."""
    die_with_parent()
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 16 << 20)
    sock.setsockopt(SOL_NETLINK, NETLINK_NO_ENOBUFS, 1)  # a lost notice is harmless: a batch verdict covers it
    sock.bind((0, 0))
    config = [
        [_nlattr(1, struct.pack("=BBH", 1, 0, 0))],  # NFQA_CFG_CMD: bind this socket to queue 0
        [_nlattr(2, struct.pack(">IB", 0, 1))],  # NFQA_CFG_PARAMS: copy the metadata only
        [_nlattr(3, struct.pack(">I", 1 << 17))],  # NFQA_CFG_QUEUE_MAXLEN
        [_nlattr(4, struct.pack(">I", 4)), _nlattr(5, struct.pack(">I", 4))],  # NFQA_CFG_MASK, _FLAGS: F_GSO
    ]
    for seq, attrs in enumerate(config, 1):
        sock.send(_nfq_message(NFQNL_MSG_CONFIG, attrs, seq, NLM_F_REQUEST | NLM_F_ACK))
        reply = sock.recv(65536)
        if struct.unpack_from("=H", reply, 4)[0] == NLMSG_ERROR:
            (error,) = struct.unpack_from("=i", reply, 16)
            if error:
                raise OSError(-error, f"NFQUEUE configuration step {seq}: {os.strerror(-error)}")
    os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(50))  # wakes on time although the ranks use every core
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0)
    sock.setblocking(False)
    due: collections.deque[float] = collections.deque()
    ids: collections.deque[bytes] = collections.deque()
    buffer = bytearray(1 << 16)
    packet = ((NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET).to_bytes(2, sys.byteorder)
    verdict = _nfq_message(NFQNL_MSG_VERDICT_BATCH, [_nlattr(2, struct.pack(">II", NF_ACCEPT, 0))], 0)[:-4]
    drop = _nfq_message(NFQNL_MSG_VERDICT, [_nlattr(2, struct.pack(">II", NF_DROP, 0))], 0)[:-4]
    chance = random.Random().random
    recv_into, send, monotonic, wait = sock.recv_into, sock.send, time.monotonic, select.select
    print("ready", flush=True)
    while True:
        if due:
            left = due[0] - monotonic()
            if left > 0:
                wait([sock], [], [], left)
        else:
            wait([sock], [], [])
        while True:
            try:
                recv_into(buffer)
            except BlockingIOError:
                break
            # nlmsghdr (16) + nfgenmsg (4), then NFQA_PACKET_HDR first: its type at 22, the packet id at 24.
            if buffer[4:6] == packet and buffer[22] == 1:
                if loss and chance() < loss:
                    send(drop + bytes(buffer[24:28]))  # now: a batch verdict accepts only packets still queued
                    continue
                due.append(monotonic() + delay)
                ids.append(bytes(buffer[24:28]))
        now, last = monotonic(), None
        while due and due[0] <= now:
            due.popleft()
            last = ids.popleft()
        if last is not None:
            send(verdict + last)  # accepts every packet up to this id


if __name__ == "__main__":
    main(float(sys.argv[1]), float(sys.argv[2]))
