#!/bin/bash
# Run `tests/bench/bench.py` on a lent machine with more cores (the device tool's nvidia-h200: 16 cores, Ubuntu
# 24.04, root, no sshd or iproute2, no PyPI), to tell gpufleet's cost from this 2-core lab's.
#   here:  bash tests/bench/lent_machine.sh prepare      # .devcarry/: Debian debs, py3.12 wheels, lab caches
#   there: bash tests/bench/lent_machine.sh setup        # (carry .devcarry) then, with the printed environment:
#          "$PY" tests/bench/bench.py --only single,batch8 --runs 3 --sglang-version 0.5.10 --no-write ...
# The debs are unpacked under /opt/gfl, never over /; only the libraries the image lacks are linked in.
set -euo pipefail
cd "$(dirname "$0")/../.."
C=.devcarry
case "${1:-}" in
prepare)
  grep -qx '/.devcarry/' .git/info/exclude 2>/dev/null || echo '/.devcarry/' >> .git/info/exclude
  mkdir -p $C/debs $C/whl $C/cache/lab-deps/py312 $C/cache/sglang-wheels
  (cd $C/debs && apt-get download -q openssh-server openssh-client openssh-sftp-server iproute2 libwrap0 libbpf1 \
     libmnl0 libelf1 libbsd0 libmd0 libcap2 libnsl2 libtirpc3 libtirpc-common libkeyutils1 libkrb5-3 \
     libgssapi-krb5-2 libk5crypto3 libkrb5support0 libcom-err2 libaudit1 libcap-ng0 libpam0g libsystemd0 \
     libselinux1 libpcre2-8-0 libcrypt1 libssl3 zlib1g libgcrypt20 libgpg-error0 liblz4-1 libzstd1 liblzma5 \
     libxtables12)
  plat="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_34_x86_64
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
        --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64"
  python3 -m pip download -q --no-deps $plat -d $C/whl ansible-core==2.19.14 resolvelib==1.0.1 cryptography cffi \
    pycparser ansible-runner==2.4.3 pexpect ptyprocess python-daemon lockfile setproctitle==1.3.8 pytest==8.3.5 \
    pluggy==1.5.0 iniconfig==2.0.0
  python3 -m pip install -q --target $C/cache/lab-deps/py312 $plat psutil==7.2.2 nvidia-ml-py==13.615.71 \
    setproctitle==1.3.8
  echo "psutil==7.2.2 nvidia-ml-py==13.615.71 setproctitle==1.3.8" > $C/cache/lab-deps/py312/.complete
  python3 -m pip download -q --no-deps --only-binary=:all: -d $C/cache/sglang-wheels sglang==0.5.10
  du -sh $C ;;
setup)
  mkdir -p /opt/gfl /usr/local/lib/gfl
  for f in $C/debs/*.deb; do dpkg -x "$f" /opt/gfl; done
  ln -sf /opt/gfl/usr/sbin/sshd /usr/sbin/sshd
  ln -sf /opt/gfl/bin/ip /usr/bin/ip
  for b in ssh ssh-keygen scp sftp; do ln -sf /opt/gfl/usr/bin/$b /usr/bin/$b; done
  for pass in 1 2 3; do
    for b in /opt/gfl/usr/sbin/sshd /opt/gfl/bin/ip /opt/gfl/usr/bin/ssh /opt/gfl/usr/bin/ssh-keygen /usr/local/lib/gfl/*; do
      ldd "$b" 2>/dev/null | awk '/not found/{print $1}'
    done | sort -u | while read -r lib; do
      f=$(find /opt/gfl -name "$lib" | head -1); if [ -n "$f" ]; then cp -L "$f" /usr/local/lib/gfl/; fi
    done
    echo /usr/local/lib/gfl > /etc/ld.so.conf.d/zz-gfl.conf; ldconfig
  done
  if ldd /usr/sbin/sshd /usr/bin/ip /usr/bin/ssh | grep "not found"; then exit 3; fi
  getent passwd sshd >/dev/null || useradd -r -M -d /run/sshd -s /usr/sbin/nologin sshd
  # into the image's own Python environment (a venv of it would not see its packages through a symlink)
  python3 -m pip install -q --no-index --no-deps --disable-pip-version-check $C/whl/*.whl
  chmod 755 .
  PY=$(python3 -c "import sys; print(sys.executable)")
  echo "export PY=$PY GPUFLEET_CACHE=$PWD/$C/cache PATH=$(dirname "$PY"):\$PATH PYTHONUNBUFFERED=1" ;;
*)
  echo "usage: $0 prepare|setup" >&2; exit 2 ;;
esac
