#!/usr/bin/env bash
# Make a private CA and every certificate and MQTT credential of one ddnn deployment.
#
#   deploy/make-certs.sh OUT_DIR --broker-host broker.lan [--broker-host 10.0.0.5] \
#       --devices cam0,cam1,cam2 [--edges edge0] [--operators operator] \
#       [--deployments default] [--cloud-host cloud.lan] [--cloud-port 8000] [--days 825] \
#       [--install-dir /etc/ddnn/tls]
#
# Writes into OUT_DIR:
#   ca.crt, ca.key            the deployment's CA (ca.key: keep it offline; only ca.crt travels)
#   broker.crt, broker.key    Mosquitto's server certificate, SAN = every --broker-host
#   cloud.crt, cloud.key      the cloud service's HTTPS certificate (with --cloud-host)
#   clients/ID.crt, ID.key    one client certificate per device, edge and operator: CN = ID,
#                             OU = its role (device, edge, operator), extendedKeyUsage
#                             clientAuth. A mutual-TLS cloud (ddnn cloud --ssl-ca-certs ca.crt)
#                             takes inference only from OU=edge, bundle downloads from edges and
#                             devices, nothing from operators
#   passwd                    Mosquitto password file (mosquitto_passwd), one user per ID
#   acl                       Mosquitto ACL for the --deployments (default: default): devices
#                             publish only their own scores, features, status and results, edges
#                             own edges/ID/requests|status and the results, operators announce
#                             bundles (see mosquitto/acl.example)
#   env/ID.env                DDNN_DEVICE_* / DDNN_EDGE_* / DDNN_ANNOUNCE_* settings for that ID
#                             (CA, certificate, key, username, password; with --cloud-host the
#                             edge's cloud token, a device's read-only download token and origin)
#                             with paths under --install-dir
#   env/cloud.env             with --cloud-host: DDNN_CLOUD_* (TLS files, the edges' token, the
#                             devices' download token)
#
# Operators (--operators, default "operator") are the identities of the people or CI jobs that
# run `ddnn announce`: `set -a; . env/operator.env; ddnn announce --broker mqtts://... ...`.
#
# Running it again with more --devices adds the new ones and keeps the CA, the existing
# certificates, passwords and tokens (a client certificate without its role is issued again,
# with the same key). Keys are EC P-256 (fast on small boards). Host names that look like
# IPv4/IPv6 addresses become IP SANs. Needs openssl; mosquitto_passwd (from the mosquitto
# package) for the password file (without it, passwd is skipped with a warning).
#
# Install on each machine: ca.crt everywhere; broker.* and passwd/acl on the broker
# (deploy/mosquitto/secure.conf); clients/ID.* and env/ID.env on device or edge ID, mode 0600.
set -euo pipefail

usage() { sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

out="" ; broker_hosts=() ; devices="" ; edges="edge0" ; operators="operator" ; cloud_host=""
deployments="default" ; cloud_port=8000 ; days=825
install_dir="/etc/ddnn/tls" ; ca_days=3650
while [ $# -gt 0 ]; do
  case "$1" in
    --broker-host) broker_hosts+=("$2"); shift 2 ;;
    --devices) devices="$2"; shift 2 ;;
    --edges) edges="$2"; shift 2 ;;
    --operators) operators="$2"; shift 2 ;;
    --cloud-host) cloud_host="$2"; shift 2 ;;
    --cloud-port) cloud_port="$2"; shift 2 ;;
    --deployments) deployments="$2"; shift 2 ;;
    --days) days="$2"; shift 2 ;;
    --ca-days) ca_days="$2"; shift 2 ;;
    --install-dir) install_dir="$2"; shift 2 ;;
    -h|--help) usage ;;
    -*) echo "make-certs: unknown option $1" >&2; usage ;;
    *) [ -z "$out" ] || usage; out="$1"; shift ;;
  esac
done
[ -n "$out" ] && [ ${#broker_hosts[@]} -gt 0 ] && [ -n "$devices" ] || usage

umask 077
mkdir -p "$out/clients" "$out/env"
cd "$out"

id_ok() { [[ "$1" =~ ^[a-z0-9][a-z0-9._-]{0,63}$ ]] || { echo "make-certs: invalid id '$1'" >&2; exit 2; }; }

san_for() {  # "DNS:a,IP:1.2.3.4" from host names
  local s="" h
  for h in "$@"; do
    if [[ "$h" =~ ^[0-9.]+$ || "$h" == *:* ]]; then s+="${s:+,}IP:$h"; else s+="${s:+,}DNS:$h"; fi
  done
  echo "$s"
}

# 1. The CA (kept if it exists: re-running adds certificates under the same CA).
if [ ! -f ca.key ]; then
  openssl req -x509 -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
    -keyout ca.key -out ca.crt -days "$ca_days" -subj "/CN=ddnn deployment CA" \
    -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
  echo "created CA: $out/ca.crt"
fi

# issue NAME SUBJECT EXTENSIONS: NAME.key + NAME.crt signed by the CA. Kept if they exist and
# the certificate has that subject; else (made before roles) issued again with the same key.
issue() {
  local name="$1" subject="$2" ext="$3" newkey=(-newkey ec -pkeyopt ec_paramgen_curve:P-256)
  if [ -f "$name.crt" ]; then
    [ "$(openssl x509 -in "$name.crt" -noout -subject -nameopt compat)" != "subject=$subject" ] \
      || return 0
    newkey=(-key "$name.key")
  fi
  openssl req -new "${newkey[@]}" -nodes \
    -keyout "$name.key" -out "$name.csr" -subj "$subject" 2>/dev/null
  printf '%b' "$ext" > "$name.ext"
  openssl x509 -req -in "$name.csr" -CA ca.crt -CAkey ca.key -CAcreateserial \
    -out "$name.crt" -days "$days" -sha256 -extfile "$name.ext" 2>/dev/null
  rm -f "$name.csr" "$name.ext"
  echo "issued $name.crt ($subject)"
}

server_ext() {
  echo "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\nsubjectAltName=$(san_for "$@")\n"
}
client_ext="basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=clientAuth\n"

# 2. Servers: the broker (and the cloud's HTTPS).
issue broker "/CN=${broker_hosts[0]}" "$(server_ext "${broker_hosts[@]}")"
[ -z "$cloud_host" ] || issue cloud "/CN=$cloud_host" "$(server_ext "$cloud_host")"

# 3. With the cloud: its environment, and the two tokens it takes (kept on re-runs): the edges'
#    (everything: inference, metadata, downloads) and the devices' (bundle downloads only).
token_of() {  # NAME: the value of DDNN_CLOUD_NAME in env/cloud.env, else a new random one
  local t=""
  [ ! -f env/cloud.env ] || t=$(sed -n "s/^DDNN_CLOUD_$1=//p" env/cloud.env)
  [ -n "$t" ] || t=$(openssl rand -hex 24)
  echo "$t"
}
if [ -n "$cloud_host" ]; then
  edge_token=$(token_of TOKEN) ; download_token=$(token_of DOWNLOAD_TOKEN)
  cloud_url="https://$cloud_host:$cloud_port"
  [[ "$cloud_host" != *:* ]] || cloud_url="https://[$cloud_host]:$cloud_port"
  cat > env/cloud.env <<EOF
DDNN_CLOUD_SSL_CERTFILE=$install_dir/cloud.crt
DDNN_CLOUD_SSL_KEYFILE=$install_dir/cloud.key
DDNN_CLOUD_SSL_CA_CERTS=$install_dir/ca.crt
DDNN_CLOUD_TOKEN=$edge_token
DDNN_CLOUD_DOWNLOAD_TOKEN=$download_token
EOF
fi

# 4. One client certificate, password and env file per device, edge and operator.
have_passwd=1
command -v mosquitto_passwd >/dev/null || {
  have_passwd=0; echo "make-certs: mosquitto_passwd not found; skipping the password file" >&2; }
ids_of() { tr ',' '\n' <<<"$1" | sed '/^$/d'; }
cloud_env() {  # ID ROLE: what the identity needs of the cloud (with --cloud-host)
  local id="$1" role="$2"
  [ -n "$cloud_host" ] || return 0
  case "$role" in
    EDGE) printf '%s\n' "DDNN_EDGE_CLOUD_CA_FILE=$install_dir/ca.crt" \
            "DDNN_EDGE_CLOUD_CERT_FILE=$install_dir/$id.crt" \
            "DDNN_EDGE_CLOUD_KEY_FILE=$install_dir/$id.key" "DDNN_EDGE_CLOUD_TOKEN=$edge_token" ;;
    DEVICE) printf '%s\n' "DDNN_DEVICE_OTA_ORIGIN=$cloud_url" \
              "DDNN_DEVICE_OTA_CA_FILE=$install_dir/ca.crt" \
              "DDNN_DEVICE_OTA_CERT_FILE=$install_dir/$id.crt" \
              "DDNN_DEVICE_OTA_KEY_FILE=$install_dir/$id.key" \
              "DDNN_DEVICE_OTA_TOKEN=$download_token" ;;
  esac
}
add_client() {  # ID ROLE(DEVICE|EDGE|ANNOUNCE) OU
  local id="$1" role="$2" ou="$3" pw envf="env/$1.env"
  id_ok "$id"
  issue "clients/$id" "/O=ddnn/OU=$ou/CN=$id" "$client_ext"
  if [ -f "$envf" ]; then return 0; fi
  pw=$(openssl rand -base64 24 | tr -d '/+=\n')
  if [ "$have_passwd" = 1 ]; then
    if [ -f passwd ]; then mosquitto_passwd -b passwd "$id" "$pw"
    else mosquitto_passwd -c -b passwd "$id" "$pw"; fi
  fi
  cat > "$envf" <<EOF
DDNN_${role}_CA_FILE=$install_dir/ca.crt
DDNN_${role}_CERT_FILE=$install_dir/$id.crt
DDNN_${role}_KEY_FILE=$install_dir/$id.key
DDNN_${role}_USERNAME=$id
DDNN_${role}_PASSWORD=$pw
EOF
  cloud_env "$id" "$role" >> "$envf"
}
for id in $(ids_of "$devices"); do add_client "$id" DEVICE device; done
for id in $(ids_of "$edges"); do add_client "$id" EDGE edge; done
for id in $(ids_of "$operators"); do add_client "$id" ANNOUNCE operator; done

# 5. The ACL, per deployment. Every write rule names one topic (no "#", no "+"), so no client can
#    make more than a few retained messages, which survive a broker restart. Patterns for every
#    device and gateway (%u = the username; a gateway's is its gateway id), a block per edge and
#    per operator.
{
  echo "# Generated by deploy/make-certs.sh; see deploy/mosquitto/acl.example for the rules."
  for dep in $(ids_of "$deployments"); do
    id_ok "$dep"
    printf '\n# deployment %s\n' "$dep"
    for kind in scores features status results; do
      echo "pattern write ddnn/$dep/devices/%u/$kind"
    done
    for kind in messages status results; do echo "pattern write ddnn/$dep/gateways/%u/$kind"; done
    echo "pattern read ddnn/$dep/devices/+/status"
    echo "pattern read ddnn/$dep/edges/+/requests"
    echo "pattern read ddnn/$dep/edges/+/status"
    echo "pattern read ddnn/$dep/bundle"
  done
  for id in $(ids_of "$edges"); do
    printf '\nuser %s\n' "$id"
    for dep in $(ids_of "$deployments"); do
      echo "topic read ddnn/$dep/devices/#"
      echo "topic read ddnn/$dep/gateways/#"
      echo "topic write ddnn/$dep/edges/$id/requests"
      echo "topic write ddnn/$dep/edges/$id/status"
      echo "topic write ddnn/$dep/results"
    done
  done
  # Operators announce bundle versions (retained) and read them back; nothing else.
  for id in $(ids_of "$operators"); do
    printf '\nuser %s\n' "$id"
    for dep in $(ids_of "$deployments"); do echo "topic readwrite ddnn/$dep/bundle"; done
  done
} > acl
chmod 0644 ca.crt broker.crt acl; [ ! -f cloud.crt ] || chmod 0644 cloud.crt
echo "done: $out (ca.key is the deployment's root of trust: keep it off the network)"
