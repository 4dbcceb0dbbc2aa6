#!/usr/bin/env bash
# Set up (or reuse) the project's virtual environment in .venv and a fast
# PyTensor backend. Sourced by run-demo.sh and run-tests.sh; safe to rerun.
#
# 1. System packages (Debian/Ubuntu): a C++ compiler and OpenBLAS with the
#    gfortran runtime that PyTensor's BLAS detection links against. Without
#    them PyTensor's C backend warns "could not link to a BLAS installation"
#    and its matrix products run several times slower.
# 2. .venv (or the folder named by $VENV) with this package installed in
#    editable mode plus the extras named in $EXTRAS (default: examples,test).
#    Reinstalled only when setup.cfg changes. $PYTHON picks the interpreter
#    that creates it (default: the first of python3.11, python3.12, python3.13,
#    python3 that runs).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
EXTRAS="${EXTRAS:-examples,test}"
VENV="${VENV:-.venv}"
PYTHON="${PYTHON:-}"
if [ -z "$PYTHON" ]; then
  # "runs", not only "is on PATH": a pyenv shim of a version that is not active fails
  for candidate in python3.11 python3.12 python3.13 python3; do
    if "$candidate" -c "import sys" >/dev/null 2>&1; then PYTHON="$candidate"; break; fi
  done
fi
[ -n "$PYTHON" ] || { echo "setup: no python3 found; install Python 3.11+" >&2; exit 1; }

# --- system packages -------------------------------------------------------
need_pkgs=()
if ! command -v g++ >/dev/null 2>&1; then need_pkgs+=(g++); fi
# Debian ships venv's pip bootstrap (ensurepip) in a separate package
if ! "$PYTHON" -c "import ensurepip" >/dev/null 2>&1 && [ ! -x "$VENV/bin/python" ]; then
  need_pkgs+=("python$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')-venv")
fi
if command -v dpkg-query >/dev/null 2>&1; then
  gcc_major="$( (gcc -dumpversion 2>/dev/null || echo 12) | cut -d. -f1)"
  for pkg in libopenblas-dev "libgfortran-${gcc_major}-dev"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" \
      || need_pkgs+=("$pkg")
  done
fi
if [ ${#need_pkgs[@]} -gt 0 ]; then
  if [ "$(id -u)" -eq 0 ]; then SUDO=""; elif command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else SUDO="none"; fi
  if [ "$SUDO" = "none" ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "setup: please install ${need_pkgs[*]} (or your system's OpenBLAS and gfortran" \
         "runtime development packages); continuing without them" >&2
  else
    echo "setup: installing ${need_pkgs[*]} with apt-get" >&2
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_pkgs[@]}" >/dev/null
  fi
fi

# --- virtual environment ---------------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV with $PYTHON" >&2
  "$PYTHON" -m venv "$VENV" || { rm -rf "$VENV"; echo "setup: '$PYTHON -m venv' failed" \
      "(on Debian/Ubuntu: apt-get install python3-venv)" >&2; exit 1; }
fi
stamp="$VENV/.lasagne_accum-installed"   # line 1: hash of the package metadata; line 2: extras
meta="$(cat setup.cfg pyproject.toml | sha1sum | cut -d' ' -f1)"
have_meta="$(sed -n 1p "$stamp" 2>/dev/null || true)"
have_extras="$(sed -n 2p "$stamp" 2>/dev/null || true)"
missing=""
for extra in ${EXTRAS//,/ }; do
  case ",$have_extras," in *",$extra,"*) ;; *) missing="$missing $extra" ;; esac
done
if [ "$have_meta" != "$meta" ] || [ -n "$missing" ]; then
  [ "$have_meta" = "$meta" ] || have_extras=""
  all="$(echo "$have_extras,$EXTRAS" | tr ',' '\n' | sed '/^$/d' | sort -u | paste -sd, -)"
  echo "setup: installing lasagne_accum[$all] into $VENV" >&2
  # --no-compile: pip would byte-compile every file of torch, JAX and Dask, one by one;
  # the BLAS check below writes the .pyc files of what it imports instead
  "$VENV/bin/python" -m pip install -q --no-compile -e ".[$all]"
  printf '%s\n%s\n' "$meta" "$all" > "$stamp"
fi

# --- a BLAS that knows this CPU under PyTensor's C backend ---------------------
VENV_ABS="$(cd "$VENV" && pwd)"
rc="$VENV_ABS/pytensorrc"
blas_choice="${LASAGNE_ACCUM_BLAS:-auto}"
case "$blas_choice" in auto|mkl|system) ;; *)
  echo "setup: LASAGNE_ACCUM_BLAS must be auto, mkl or system, got '$blas_choice'" >&2; exit 1 ;;
esac
checked="$VENV/.lasagne_accum-blas"   # the choice and package metadata it was checked for
if [ "$(cat "$checked" 2>/dev/null)" != "$blas_choice $meta" ]; then
  [ "$blas_choice" = mkl ] || rm -f "$rc"
  # The report imports PyTensor, Numba, SciPy, JAX and PyTorch: it writes their .pyc files
  # into $VENV (as pip's byte-compiling would have) even where PYTHONDONTWRITEBYTECODE is
  # set, so that later processes (the tests', the examples', Dask's workers) do not compile
  # those sources again at each import.
  report() {
    if [ -f "$rc" ]; then set -- PYTENSORRC="$rc:${PYTENSORRC:-$HOME/.pytensorrc}"; else set --; fi
    env -u PYTHONDONTWRITEBYTECODE "$@" "$VENV/bin/python" -m lasagne_accum
  }
  verdict=0
  if [ "$blas_choice" != mkl ]; then
    echo "setup: checking the BLAS of PyTensor's C backend (python -m lasagne_accum)" >&2
    report || verdict=$?
  fi
  if [ "$blas_choice" = mkl ] || { [ "$verdict" -eq 3 ] && [ "$blas_choice" = auto ]; }; then
    if [ "$(uname -s)-$(uname -m)" != Linux-x86_64 ]; then
      echo "setup: warning: no fast BLAS to install here (MKL's wheel is for x86_64 Linux);" \
           "see docs/troubleshooting.rst, 'A slow BLAS'" >&2
    else
      echo "setup: installing Intel's MKL wheel into $VENV for PyTensor's C backend" >&2
      "$VENV/bin/python" -m pip install -q --no-compile mkl
      mkl="$(ls "$VENV_ABS"/lib/libmkl_rt.so.* 2>/dev/null | sort -V | tail -1)"
      [ -n "$mkl" ] || { echo "setup: the mkl wheel has no libmkl_rt.so.*" >&2; exit 1; }
      ln -sf "$(basename "$mkl")" "$VENV_ABS/lib/libmkl_rt.so"
      printf '[blas]\nldflags = -L%s/lib -lmkl_rt -Wl,-rpath,%s/lib\n' "$VENV_ABS" "$VENV_ABS" > "$rc"
      report || echo "setup: warning: PyTensor's C backend is still slow with MKL;" \
                     "default_modes() compiles with Numba where that is faster" >&2
    fi
  elif [ "$verdict" -ne 0 ] && [ "$verdict" -ne 3 ]; then
    echo "setup: python -m lasagne_accum failed (exit $verdict)" >&2; exit 1
  fi
  activate="$VENV/bin/activate"
  sed -i '/# lasagne_accum: PyTensor reads the BLAS set-up/,+1d' "$activate"
  if [ -f "$rc" ]; then
    printf '# lasagne_accum: PyTensor reads the BLAS set-up of scripts/setup.sh\nexport PYTENSORRC="%s:${PYTENSORRC:-$HOME/.pytensorrc}"\n' "$rc" >> "$activate"
  fi
  echo "$blas_choice $meta" > "$checked"
fi
