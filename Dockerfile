# syntax=docker/dockerfile:1
# ms-deepseek for Atlas 800T A2 (8 x Ascend 910B per node): CANN + MindSpore + this package.
#
#   docker build -t ms-deepseek:ascend .
#   docker run --rm -it --device=/dev/davinci0 ... --device=/dev/davinci7 \
#     --device=/dev/davinci_manager --device=/dev/devmm_svm --device=/dev/hisi_hdc \
#     -v /usr/local/Ascend/driver:/usr/local/Ascend/driver:ro \
#     -v "$(command -v npu-smi)":/usr/local/bin/npu-smi:ro -v /usr/local/dcmi:/usr/local/dcmi:ro \
#     -v /etc/ascend_install.info:/etc/ascend_install.info:ro -v /etc/hccn.conf:/etc/hccn.conf:ro \
#     -v /data/runs:/workspace/runs --network=host --shm-size=64g \
#     ms-deepseek:ascend doctor --level 8
#
# npu-smi in the container needs the host's DCMI library (/usr/local/dcmi) and
# /etc/ascend_install.info as well as the driver (cann-container-image README, "Usage").
# Hosts install npu-smi as /usr/local/sbin/npu-smi or /usr/local/bin/npu-smi (the README
# mounts the latter); a bind mount of the one the host lacks gives the container an empty
# folder there. `command -v npu-smi` (run as root: its PATH has both) names the one this host
# has, mounted on the container's PATH; with none the mount spec is empty and docker refuses
# to start. The entrypoint warns when npu-smi in the container is a folder.
#
# CANN_IMAGE: a CANN base image for 910B with the CANN release MindSpore 2.9.0 is built
# for (CANN 9.0.0, driver/firmware 26.0.RC1 on the host; `ms-deepseek doctor` checks
# both). Python 3.11 matches setup.py's python_requires. Override it for a mirror or
# another OS: --build-arg CANN_IMAGE=<registry>/cann:9.0.0-910b-openeuler24.03-py3.11
#
# MindSpore line: 2.9 (requirements.txt) by default; --build-arg MS_DEEPSEEK_MINDSPORE=2.10 installs
# requirements-ms2.10.txt instead (setup.py runtime_pins). Give it the CANN image that MindSpore 2.10 is built
# for with --build-arg CANN_IMAGE=...: no CANN release is recorded for 2.10 here (pins.MINDSPORE_CANN), and
# `ms-deepseek doctor` warns that it knows no pairing for it.
ARG CANN_IMAGE=quay.io/ascend/cann:9.0.0-910b-ubuntu22.04-py3.11
FROM ${CANN_IMAGE}

# HwHiAiUser's group id must match the host's, so the non-root user can open /dev/davinci*.
ARG USER_UID=1000
ARG ASCEND_GID=1000

ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HCCL_CONNECT_TIMEOUT=1800 \
    HCCL_EXEC_TIMEOUT=3600 \
    GLOG_v=2

WORKDIR /opt/ms-deepseek
# The pins: requirements.txt (or the chosen line's requirements-ms<line>.txt) is the one source of truth
# (setup.py reads the same file, choosing it by MS_DEEPSEEK_MINDSPORE, which the build arg sets for every RUN).
ARG MS_DEEPSEEK_MINDSPORE=
COPY requirements.txt requirements-ms2.10.txt requirements-test.txt setup.py README.md ./
RUN if [ -z "${MS_DEEPSEEK_MINDSPORE}" ] || [ "${MS_DEEPSEEK_MINDSPORE}" = 2.9 ]; then \
      python3 -m pip install --no-cache-dir -r requirements.txt; \
    else \
      python3 -m pip install --no-cache-dir -r "requirements-ms${MS_DEEPSEEK_MINDSPORE}.txt"; \
    fi
# ms_deepseek/ops_src is a symlink to ../ops (the kernel sources): both must be in the image,
# or the installed package carries a dangling link and no kernel sources.
COPY ms_deepseek ./ms_deepseek
COPY ops ./ops
COPY recipes ./recipes
COPY tools/ascend_dryrun.sh ./tools/ascend_dryrun.sh
# BUILD_KERNELS=1 compiles the Ascend C operators with the image's CANN (no NPU needed) and
# installs them under /opt/ms-deepseek/opp; 0 skips it (then run ops/build_ascend.sh at run time).
ARG BUILD_KERNELS=1
ENV ASCEND_CUSTOM_OPP_PATH=/opt/ms-deepseek/opp/vendors/ms_deepseek
RUN python3 -m pip install --no-cache-dir --no-deps . \
 && if [ "${BUILD_KERNELS}" = 1 ]; then bash ops/build_ascend.sh --install-path /opt/ms-deepseek/opp; fi \
 && if ! command -v python >/dev/null; then ln -s "$(command -v python3)" /usr/local/bin/python; fi \
 && (getent group "${ASCEND_GID}" >/dev/null || groupadd --gid "${ASCEND_GID}" HwHiAiUser) \
 && useradd --create-home --uid "${USER_UID}" --gid "${ASCEND_GID}" --shell /bin/bash msd \
 && mkdir -p /workspace \
 && chown msd:"${ASCEND_GID}" /workspace
COPY --chmod=0755 docker-entrypoint.sh /usr/local/bin/ms-deepseek-entrypoint

USER ${USER_UID}:${ASCEND_GID}
WORKDIR /workspace
ENTRYPOINT ["/usr/local/bin/ms-deepseek-entrypoint"]
CMD ["doctor", "--level", "1"]
